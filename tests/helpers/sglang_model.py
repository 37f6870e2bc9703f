"""A tiny local model's configuration, published to SGLang's runtime context as a scheduler publishes it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: A one-layer Llama small enough for SGLang's constructors to read on a CPU.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 128,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "torch_dtype": "float32",
}  # fmt: skip


def publish_tiny_llama(runtime_context: Any, directory: Path) -> None:
    """Write :data:`TINY_LLAMA` to ``directory`` and publish server arguments for it (device ``cpu``)."""
    from sglang.srt.server_args import ServerArgs

    (Path(directory) / "config.json").write_text(json.dumps(TINY_LLAMA))
    runtime_context.publish(
        ServerArgs(model_path=str(directory), skip_tokenizer_init=True, device="cpu"), role="scheduler"
    )
