"""Tool-calling agents routed on the tokens vLLM computes for them: the request's ``tools`` are rendered by the
model's chat template, as vLLM renders them, so each agent's tool block is a prefix the router matches, as the
engine caches it (without them, the router's tokens would leave the engine's at the tool block). Runs offline: ``python
examples/agent_tools.py`` (a tiny model folder is built in a temporary directory: a byte-level tokenizer and a
ChatML-style template that lists the tools in the system turn, as tool-calling models' templates do)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from prefixroute import Router
from prefixroute.adapters.serve import PromptEncoder

TEMPLATE = """{% for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}
{%- if m.role == 'system' and tools %}
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def tool(name: str, description: str, **parameters: str) -> dict[str, object]:
    properties = {key: {"type": kind} for key, kind in parameters.items()}
    schema = {"type": "object", "properties": properties, "required": list(parameters)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


AGENTS = {
    "travel agent": [tool("search_flights", "Find flights between two cities", origin="string", to="string"),
                     tool("book_hotel", "Book a hotel room", city="string", nights="integer")],
    "data agent": [tool("run_sql", "Run a read-only SQL query", query="string"),
                   tool("plot", "Plot a table's columns", table="string", x="string", y="string")],
}  # fmt: skip
SYSTEM = "You are a helpful assistant. Call a tool when it helps; answer briefly."


def model_folder(folder: Path) -> Path:
    """A tokenizer with one token per byte, and the chat template above."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return folder


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        encoder = PromptEncoder(model_folder(Path(tmp)))
    router = Router(block_size=16)
    backends = ["http://gpu0:8000", "http://gpu1:8000"]
    for question in ("Paris to Rome, Friday?", "Total sales by month?", "Two nights in Rome?", "Plot it."):
        for agent, tools in AGENTS.items():
            body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                    "tools": tools}  # fmt: skip
            tokens = encoder.encode_chat_request(body)  # as vLLM renders it: the tools are in the prompt
            decision = router.route(tokens, backends)
            router.start(decision)
            router.first_token(decision)
            router.finish(decision)
            print(f"{agent:<12} {question!r:26} -> {decision.backend} ({decision.reason}, "
                  f"{decision.matched_tokens}/{len(tokens)} tokens cached)")  # fmt: skip
    bare = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    with_tools = encoder.encode_chat_request({"messages": bare, "tools": AGENTS["data agent"]})
    print(f"the data agent's tools add {len(with_tools) - len(encoder.encode_chat(bare))} tokens to every prompt")


if __name__ == "__main__":
    main()
