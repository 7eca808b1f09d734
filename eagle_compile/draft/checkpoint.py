"""Load and save draft heads in the official EAGLE-3 and the speculators layouts (EAGLE31_SPEC.md §3).

Loading is strict: every tensor of the file must be a tensor of the head described by ``config.json`` (with
the shape the config implies) and every tensor of the head must be in the file. The only optional tensors
are ``embed_tokens.weight`` (the target's table is used when absent), ``d2t``/``t2d`` (identity for a full
vocabulary; ``t2d`` is derived from ``d2t``) and, when ``draft_vocab_size`` is null and a target is given,
``lm_head.weight`` (taken from the target, as SGLang does, §1.4). Nothing is dropped silently. Every weight
must be finite in the dtype it is loaded in, and a file the loaders cannot parse is refused naming it.

Key names: ``midlayer.*`` (official) and ``layers.0.*`` (speculators, vLLM) are the same tensors; a ``model.``
prefix (NeMo) is removed. Saving writes exactly the layout asked for.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from eagle_compile.capture_indices import CONFIG_KEY
from eagle_compile.draft.config import DraftConfig
from eagle_compile.draft.model import EagleDraftModel
from eagle_compile.draft.vocab import validate_vocab_mapping
from eagle_compile.errors import CheckpointError

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
_OPTIONAL = ("embed_tokens.weight", "d2t", "t2d")


def load_draft(
    path: str | Path,
    target: nn.Module | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    num_target_layers: int | None = None,
) -> EagleDraftModel:
    """Load a draft head from a directory holding ``config.json`` and the weights.

    ``target`` (an HF causal LM) gives the layer count that resolves the capture indices and the embedding
    table; without it, give ``num_target_layers`` or use a config that states
    ``eagle_aux_hidden_state_layer_ids``, and call ``tie_target_embedding`` before running the head.
    ``dtype=None`` keeps the checkpoint's dtype (that of ``lm_head.weight``).
    """
    path = Path(path)
    raw = _read_config(path)
    target_cfg = _text_config(target) if target is not None else None
    if target_cfg is not None:
        layers = int(target_cfg.num_hidden_layers)
        if num_target_layers is not None and num_target_layers != layers:
            raise CheckpointError(
                f"num_target_layers={num_target_layers} contradicts the target, which has {layers} layers"
            )
        num_target_layers = layers

    layout = "speculators" if ("speculators_model_type" in raw or "speculators_config" in raw) else "eagle3"
    reader = DraftConfig.from_speculators_dict if layout == "speculators" else DraftConfig.from_hf_dict
    try:
        config = reader(raw, num_target_layers)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from e
    if config.capture_indices is None:
        raise CheckpointError(
            f"{path / 'config.json'} does not state {CONFIG_KEY} and no target was given, so the capture "
            "indices (which target layers feed the head) are unknown. Pass target=<the target model> or "
            "num_target_layers=N (the EAGLE-3 default (2, N//2, N-3) is then used)."
        )
    if target_cfg is not None:
        check_target_config(config, target_cfg, path / "config.json")

    raw_tensors, source = _read_weights(path)
    tensors = _canonical_keys(raw_tensors)
    embed = tensors.pop("embed_tokens.weight", None)
    d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
    if "lm_head.weight" not in tensors and raw.get("draft_vocab_size") is None and target is not None:
        tensors["lm_head.weight"] = target.get_output_embeddings().weight.detach()

    with torch.device("meta"):
        model = EagleDraftModel(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in _OPTIONAL}
    _check_keys(path, config, tensors, expected)
    if embed is not None and tuple(embed.shape) != (config.vocab_size, config.hidden_size):
        raise CheckpointError(
            f"embed_tokens.weight has shape {list(embed.shape)}, expected "
            f"[vocab_size, hidden_size] = [{config.vocab_size}, {config.hidden_size}]"
        )
    d2t, t2d = validate_vocab_mapping(d2t, t2d, config.vocab_size, config.draft_vocab_size)

    dtype = dtype or tensors["lm_head.weight"].dtype
    # copies: tensors read from a file can sit at any byte offset, and MKL's results for the same values depend
    # on their alignment (a round trip would not be bit for bit); torch's own allocations are aligned
    state = {k: v.to(device=device, dtype=dtype, copy=True) for k, v in tensors.items()}  # all floating (checked)
    state["d2t"], state["t2d"] = d2t.to(device), t2d.to(device)
    model.load_state_dict(state, strict=True, assign=True)
    model.to(model.lm_head.weight.device)  # the RoPE tables were built on the CPU
    if embed is not None:
        model.tie_target_embedding(embed, owned=True)
        tensors["embed_tokens.weight"], state["embed_tokens.weight"] = embed, model.embed_tokens.weight
    elif target is not None:
        model.tie_target_embedding(target)
    _check_finite(source, tensors, state, dtype)
    model.source_dir = path.resolve()
    return model.eval()


def save_draft(
    model: EagleDraftModel,
    path: str | Path,
    layout: Literal["eagle3", "speculators"] = "eagle3",
    *,
    speculative_tokens: int = 3,
    verifier_name_or_path: str | None = None,
) -> None:
    """Write ``config.json`` and ``model.safetensors`` in the official (``eagle3``) or speculators layout.

    The target's embedding is never written; an embedding that came with a speculators checkpoint is
    written back in the speculators layout only (the official layout has no such key).
    """
    dtype = str(model.lm_head.weight.dtype).removeprefix("torch.")
    if layout == "eagle3":
        config = model.config.to_hf_dict(torch_dtype=dtype)
    elif layout == "speculators":
        config = model.config.to_speculators_dict(
            speculative_tokens=speculative_tokens,
            verifier_name_or_path=verifier_name_or_path,
            torch_dtype=dtype,
        )
    else:
        raise ValueError(f"layout must be 'eagle3' or 'speculators', got {layout!r}")
    embedding = layout == "speculators" and model.embed_tokens.owned
    write_draft(path, config, draft_tensors(model, layout, embedding=embedding))


def draft_tensors(
    model: EagleDraftModel, layout: Literal["eagle3", "speculators"], *, embedding: bool = False
) -> dict[str, torch.Tensor]:
    """The head's tensors under the key names of ``layout`` (``midlayer.*`` or ``layers.0.*``), on the CPU.

    ``embedding=True`` adds ``embed_tokens.weight``, which only a table the head owns may be (never the
    target's own table).
    """
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if layout == "speculators":
        state = {_rename(k, "midlayer.", "layers.0."): v for k, v in state.items()}
    if embedding:
        if not model.embed_tokens.owned:
            raise ValueError(
                "embedding=True, but the head's embed_tokens is the target's table, which is never written "
                "into a draft checkpoint"
            )
        state["embed_tokens.weight"] = model.embed_tokens.weight.detach().cpu().contiguous()
    return state


def write_draft(path: str | Path, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into the folder ``path`` (created if missing)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(dict(tensors), str(path / SAFETENSORS), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


# --------------------------------------------------------------------------------------------------
def _read_config(path: Path) -> dict[str, Any]:
    file = path / "config.json"
    if not path.exists():
        raise CheckpointError(f"draft checkpoint folder {path} does not exist")
    if path.is_file():
        raise CheckpointError(f"{path} is a file; pass the folder that holds it and its config.json")
    if not file.is_file():
        raise CheckpointError(
            f"{path} has no config.json; a draft checkpoint is a directory holding config.json and weights"
        )
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _read_weights(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """``model.safetensors`` (or its shards), else ``pytorch_model.bin`` (loaded with weights_only=True); and the
    file(s) read, for messages."""
    from safetensors.torch import load_file

    if (path / SAFETENSORS).is_file():
        return _read_file(path / SAFETENSORS, load_file), str(path / SAFETENSORS)
    if (path / SAFETENSORS_INDEX).is_file():
        index = _read_index(path / SAFETENSORS_INDEX)
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(set(index.values())):
            if not (path / shard).is_file():
                raise CheckpointError(f"{path / SAFETENSORS_INDEX} names the shard {shard}, which is not in {path}; "
                                      "download every shard the index lists")
            tensors.update(_read_file(path / shard, load_file))
        return tensors, f"the shards of {path / SAFETENSORS_INDEX}"
    if (path / TORCH_BIN).is_file():
        state = _read_file(path / TORCH_BIN, lambda f: torch.load(f, map_location="cpu", weights_only=True))
        if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"{path / TORCH_BIN} does not hold a flat state dict of tensors")
        return dict(state), str(path / TORCH_BIN)
    raise CheckpointError(
        f"{path} has no weights: expected {SAFETENSORS}, {SAFETENSORS_INDEX} or {TORCH_BIN} there"
    )


def _read_file(file: Path, load: Any) -> Any:
    """``load(file)``; a file the loader cannot parse (truncated by an interrupted download, not a weights file)
    is refused naming it, instead of the loader's bare message (safetensors: "incomplete metadata, file not
    fully covered"; torch.load of a cut zip: "[Errno 22] Invalid argument")."""
    try:
        return load(str(file))
    except Exception as e:       # the loaders raise their own types (SafetensorError, OSError, UnpicklingError...)
        raise CheckpointError(
            f"{file} cannot be read ({file.stat().st_size} bytes; {type(e).__name__}: {e}): the file is truncated "
            "or corrupt, e.g. an interrupted download; download or save it again"
        ) from e


def _read_index(file: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(file.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{file} is not a safetensors index (a JSON object with a weight_map): {e!r}; "
                              "download it again") from e
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{file}: weight_map must map tensor names to shard files")
    return weight_map


def _check_finite(source: str, raw: Mapping[str, torch.Tensor], loaded: Mapping[str, torch.Tensor],
                  dtype: torch.dtype) -> None:
    """Refuse NaN/inf weights: the head would still load and run, and verification would keep the output exact,
    but every proposal would be garbage (acceptance silently near zero). Distinguishes a broken file from
    finite values that overflow the dtype asked for (a float32 head loaded as float16)."""
    bad = [k for k, v in loaded.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if not bad:
        return
    broken = [k for k in bad if not bool(torch.isfinite(raw[k]).all())]
    if broken:
        k = broken[0]
        count = int((~torch.isfinite(raw[k])).sum())
        also = f" (also NaN/inf: {broken[1:]})" if len(broken) > 1 else ""
        raise CheckpointError(
            f"{source}: tensor {k!r} holds {count} NaN/inf values of {raw[k].numel()}{also}; the head is broken "
            "(a diverged training run or a corrupt file): use another checkpoint or retrain it"
        )
    peak = max(float(raw[k].abs().max()) for k in bad)
    raise CheckpointError(
        f"{source}: tensors {bad} are finite in the file ({raw[bad[0]].dtype}) but overflow {dtype} (largest "
        f"|value| {peak:.4g}); load the head with dtype=torch.float32 or torch.bfloat16 (generate loads a folder in "
        "the target's dtype: run the target in one of those)"
    )


def _rename(key: str, old: str, new: str) -> str:
    return new + key[len(old) :] if key.startswith(old) else key


def _canonical_keys(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official key names: ``layers.0.`` -> ``midlayer.``, a leading ``model.`` removed."""
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        name = _rename(_rename(key, "model.", ""), "layers.0.", "midlayer.")
        if name in out:
            raise CheckpointError(
                f"the checkpoint holds the same tensor twice under different names ({name!r} and {key!r}, "
                "e.g. both midlayer.* and layers.0.*); keep one"
            )
        out[name] = value
    return out


def _check_keys(
    path: Path,
    config: DraftConfig,
    tensors: Mapping[str, torch.Tensor],
    expected: Mapping[str, tuple[int, ...]],
) -> None:
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
        hints = []
        if any(k.startswith("fc_norm.") for k in unexpected):
            hints.append("fc_norm.* weights exist but config.json does not set fc_norm: true")
        if "input_norm.weight" in unexpected:
            hints.append("input_norm.weight exists but config.json does not set norm_before_fc: true")
        if any(k.startswith("layers.") for k in unexpected):
            hints.append("extra decoder layers (layers.1.*) are not supported: single-layer heads only")
        if hints:
            problems.append("; ".join(hints))
    if problems:
        raise CheckpointError(
            f"{path}: the weights do not match config.json: " + "; ".join(problems) + ". Fix the "
            "config.json flags or the weights file; no tensor is skipped or invented."
        )
    bad = [
        f"{k}: shape {list(tensors[k].shape)}, expected {list(shape)}"
        for k, shape in expected.items()
        if tuple(tensors[k].shape) != shape
    ]
    if bad:
        raise CheckpointError(
            f"{path}: tensors with the wrong shape for config.json (hidden_size {config.hidden_size}, "
            f"target_hidden_size {config.target_hidden_size}, {config.num_features} features, "
            f"draft_vocab_size {config.draft_vocab_size}): " + "; ".join(bad)
        )
    floating = [k for k, v in tensors.items() if not v.is_floating_point()]
    if floating:
        raise CheckpointError(f"{path}: weights {floating} are not floating-point tensors")


def _text_config(target: nn.Module) -> Any:
    cfg = getattr(target, "config", None)
    if cfg is None:
        raise CheckpointError(f"target {type(target).__name__} has no .config; pass a Hugging Face causal LM")
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def check_target_config(config: DraftConfig, target_cfg: Any, where: Any = "the draft head") -> None:
    """Refuse a head made for another target (its HF config): its embedding table (vocabulary) and its fc input
    (the target's hidden size) would not fit, which otherwise fails deep inside the first draft forward.
    ``where`` names the head (its config.json) in the message."""
    if int(target_cfg.vocab_size) != config.vocab_size:
        raise CheckpointError(
            f"{where}: the draft head was trained for a target vocabulary of {config.vocab_size} ids but this "
            f"target has vocab_size {target_cfg.vocab_size}; use the head made for this target"
        )
    if int(target_cfg.hidden_size) != config.target_hidden_size:
        raise CheckpointError(
            f"{where}: the draft head expects target features of width {config.target_hidden_size} but this "
            f"target has hidden_size {target_cfg.hidden_size}; use the head made for this target"
        )
