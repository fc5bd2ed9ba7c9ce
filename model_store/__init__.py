"""The local model store: checkpoints on disk, fetched by name or imported from GGUF.

Owns where checkpoints live, the table of known models, fetching one (`store`) and converting a
Llama-family GGUF file into a Hugging Face checkpoint directory (`gguf_import`, with the GGUF
vocabulary turned into a `tokenizers` file by `gguf_tokenizer`). The services use it only to turn
a name or a path into a checkpoint directory. Never imports torch, nor any service.
"""

from .store import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    KnownModel,
    ModelStoreError,
    cache_root,
    fetch_model,
    model_dir,
    resolve_model,
)

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "KnownModel",
    "ModelStoreError",
    "cache_root",
    "fetch_model",
    "model_dir",
    "resolve_model",
]
