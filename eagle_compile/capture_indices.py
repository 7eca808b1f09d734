"""The feature capture-index convention, written down once (EAGLE31_SPEC.md §0, §1.1, §9.1).

A *capture index* ``k`` names the residual-stream tensor that **enters** decoder layer ``k``: the value
``hidden + residual`` after layer ``k - 1`` has run and before any norm. So

* ``k = 0`` is the token embeddings,
* ``k = i + 1`` is the output of decoder layer ``i``,
* ``k = N`` is the output of the last layer *before* the target's final norm,

and capture index ``k`` equals Hugging Face ``output_hidden_states[k]`` for every ``k < N`` (HF overwrites
``hidden_states[N]`` with the post-final-norm value, so index ``N`` is compared against the pre-norm tensor).

This is the convention of the official EAGLE code, vLLM (``eagle_aux_hidden_state_layer_ids`` used directly)
and speculators. The default is ``(2, N // 2, N - 3)``: low, mid, high. TorchSpec and SpecForge write the same
tensors as post-layer ids ``[1, N//2 - 1, N - 4]``; SGLang adds +1 to ids it reads from a config. We read every
checkpoint's ``eagle_aux_hidden_state_layer_ids`` with capture-index semantics (top level first, then nested
``eagle_config``), and write them back the same way, so a head trained here is served with the same layers by
vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

CONFIG_KEY = "eagle_aux_hidden_state_layer_ids"


def default_capture_indices(num_layers: int) -> tuple[int, int, int]:
    """The EAGLE-3 default ``(2, N // 2, N - 3)`` for a target with ``num_layers`` decoder layers."""
    indices = (2, num_layers // 2, num_layers - 3)
    if not indices[0] < indices[1] < indices[2]:
        raise ValueError(
            f"the default EAGLE-3 capture indices (2, N//2, N-3) = {indices} are not distinct and increasing for "
            f"a target with N={num_layers} decoder layers (N >= 7 is needed). Pass explicit capture indices "
            f"(draft config key '{CONFIG_KEY}')."
        )
    return indices


def validate_capture_indices(indices: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Check that ``indices`` are capture indices of a ``num_layers``-layer target; return them as a tuple."""
    out = tuple(int(i) for i in indices)
    if not out:
        raise ValueError(f"'{CONFIG_KEY}' is empty; give at least one capture index in [0, {num_layers}]")
    bad = [i for i in out if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(
            f"capture indices {bad} are outside [0, {num_layers}] for a target with {num_layers} decoder layers "
            f"(capture index k = the residual stream entering layer k; k = {num_layers} is the last layer's "
            f"pre-norm output). Post-layer ids (TorchSpec/SpecForge style) must be converted with +1."
        )
    if len(set(out)) != len(out):
        raise ValueError(f"capture indices {list(out)} contain duplicates")
    return out


def capture_indices_from_config(config: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    """Capture indices stated by a draft config (top level, then ``eagle_config``), else the default."""
    ids = config.get(CONFIG_KEY)
    if ids is None and isinstance(config.get("eagle_config"), Mapping):
        ids = config["eagle_config"].get(CONFIG_KEY)
    if ids is None:
        return default_capture_indices(num_layers)
    return validate_capture_indices(ids, num_layers)
