"""Draft heads written as the folders vLLM, SGLang and speculators load (``eagle31 export``, DESIGN.md §7).

The three engines read one EAGLE-3 head three ways. What differs, and would change the drafts if written
the wrong way (read from each engine's source; tests/export/test_export_heads.py cites the files):

| | ``vllm`` | ``sglang`` | ``speculators`` (served by vLLM) |
|---|---|---|---|
| ``architectures`` | ``LlamaForCausalLMEagle3`` | ``LlamaForCausalLMEagle3`` | ``Eagle3Speculator`` |
| capture index k | top level: k | ``eagle_config``: k - 1 (SGLang adds 1) | top level: k |
| weight names | ``midlayer.*`` | ``midlayer.*`` | ``layers.0.*`` |
| ``norm_before_residual`` | read | never read (always off) | read (vLLM: absent = true) |
| ``norm_before_fc`` | read | never read | read |
| ``fc_norm``, ``norm_output`` | read | read | read |
| own ``embed_tokens.weight`` | loaded | replaced by the target's | loaded |

Every flag and the capture indices are written explicitly, so no engine default decides anything. A head
an engine cannot run as it runs here is refused with an `ExportError` naming the flag (or setting) and the
engine; nothing is dropped. Capture indices (``eagle_compile.capture_indices``) must lie in ``1..N-1`` for
every engine: vLLM's and SGLang's Llama, Qwen and Mistral models record the residual stream entering layer
``k`` inside their layer loop, so ``k = 0`` (no residual yet) and ``k = N`` (after the loop) never arrive.

The SGLang folder states the capture indices twice, each where its reader looks: ``eagle_config`` in
SGLang's convention, the top level in ours (vLLM and `load_draft` read the top level first). The speculators
folder repeats ``norm_before_fc``, ``fc_norm`` and ``norm_output`` inside ``transformer_layer_config``: vLLM
builds the draft's config from that dict, and releases whose speculators translation does not copy those
three flags would otherwise run the head without them.

Engines older than their EAGLE 3.1 support cannot be detected from here: vLLM before its post-norm support
(vLLM PR #42764) refuses ``fc_norm.*`` weights but ignores ``norm_output``; SGLang releases whose
``llama_eagle3.py`` predates ``fc_norm``/``norm_output`` skip both without a word. Outputs stay exact (the
target verifies every token); only acceptance suffers. `ENGINE_NOTES` says so for the command line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from eagle_compile.capture_indices import CONFIG_KEY
from eagle_compile.draft.checkpoint import SAFETENSORS, draft_tensors, write_draft
from eagle_compile.draft.model import EagleDraftModel
from eagle_compile.errors import ExportError

Engine = Literal["vllm", "sglang", "speculators"]
ENGINES: tuple[Engine, ...] = ("vllm", "sglang", "speculators")
_MIRRORED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")
ENGINE_NOTES = {
    "vllm": "needs a vLLM with EAGLE 3.1 support (fc_norm / norm_output, vLLM PR #42764)",
    "sglang": "needs an SGLang whose llama_eagle3.py reads fc_norm / norm_output; older releases skip them "
              "silently (exact output, lower acceptance)",
    "speculators": "needs a vLLM with EAGLE 3.1 support (fc_norm / norm_output, vLLM PR #42764)",
}
_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "speculators": "vLLM (which serves speculators heads)"}


def export_head(
    head: EagleDraftModel,
    out: str | Path,
    engine: Engine,
    *,
    num_target_layers: int,
    verifier_name_or_path: str | None = None,
    verifier_architectures: Sequence[str] = (),
    speculative_tokens: int = 3,
    overwrite: bool = False,
) -> Path:
    """Write ``head`` into the folder ``out`` in the layout ``engine`` loads; return the folder.

    Args:
        head: the draft head (e.g. from `load_draft`); its dtype is kept.
        out: the folder to create; an existing non-empty folder is refused unless ``overwrite``.
        engine: ``"vllm"``, ``"sglang"`` or ``"speculators"``.
        num_target_layers: N, the target's decoder layers (resolves and checks the capture indices).
        verifier_name_or_path, verifier_architectures: the target as the speculators config names it
            (``speculators_config.verifier``; vLLM takes it as the target model). Speculators only.
        speculative_tokens: draft tokens per step in the speculators proposal method. Speculators only.
        overwrite: replace the files of a folder that already holds some.

    Raises:
        ExportError: the engine cannot run this head as eagle_compile runs it (the message says why).
    """
    if engine not in ENGINES:
        raise ExportError(f"unknown export format {engine!r}; head folders can be written for {list(ENGINES)}")
    out = Path(out)
    _check_destination(head, out, overwrite)
    indices = head.config.resolved_capture_indices(num_target_layers)
    config = dataclasses.replace(head.config, capture_indices=indices)
    _check_common(head, config, engine, num_target_layers)
    dtype = str(head.lm_head.weight.dtype).removeprefix("torch.")
    if engine == "speculators":
        _check_speculators(config)
        layout = "speculators"
        data = _speculators_config(config, dtype, speculative_tokens, verifier_name_or_path,
                                   verifier_architectures)
    else:
        if engine == "sglang":
            _check_sglang(head, config)
        layout = "eagle3"
        data = _hf_config(config, dtype, sglang=engine == "sglang")
    tensors = draft_tensors(head, layout, embedding=head.embed_tokens.owned)
    if engine == "speculators" and config.draft_vocab_size == config.vocab_size:
        # speculators registers d2t/t2d only for a reduced vocabulary; vLLM then keeps full-vocab logits
        del tensors["d2t"], tensors["t2d"]
    return write_draft(out, data, tensors)


# --------------------------------------------------------------------------------------------------
def _hf_config(config, dtype: str, *, sglang: bool) -> dict[str, Any]:
    """The flat Llama ``config.json`` of vLLM's and SGLang's ``LlamaForCausalLMEagle3``."""
    data = config.to_hf_dict(torch_dtype=dtype)
    # both engines size fc from this key (else from eagle_config's ids, else 3 features)
    data["num_aux_hidden_states"] = len(config.capture_indices)
    if sglang:
        data["eagle_config"] = {
            CONFIG_KEY: [k - 1 for k in config.capture_indices],   # SGLang captures id + 1
            "use_aux_hidden_state": True,
        }
    return data


def _speculators_config(config, dtype, speculative_tokens, verifier_name_or_path, verifier_architectures):
    data = config.to_speculators_dict(
        speculative_tokens=speculative_tokens,
        verifier_name_or_path=verifier_name_or_path,
        verifier_architectures=verifier_architectures,
        torch_dtype=dtype,
    )
    data["transformer_layer_config"].update({name: data[name] for name in _MIRRORED_FLAGS})
    return data


def _check_destination(head: EagleDraftModel, out: Path, overwrite: bool) -> None:
    source = getattr(head, "source_dir", None)
    if source is not None and out.resolve() == Path(source).resolve():
        raise ExportError(
            f"the export folder {out} is the folder the head was loaded from; write the export elsewhere "
            "(it would replace the original checkpoint)"
        )
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a folder; give a folder path for the export")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(
            f"{out} already holds files ({', '.join(sorted(p.name for p in out.iterdir())[:5])}); give an "
            f"empty or new folder, or pass overwrite=True (--overwrite) to replace config.json and {SAFETENSORS}"
        )


def _check_common(head: EagleDraftModel, config, engine: str, n: int) -> None:
    reader = _NAMES[engine]
    if not config.use_aux_hidden_state:
        raise ExportError(
            f"use_aux_hidden_state=false cannot be exported for {reader}: this head was trained on capture "
            f"index N={n} (the last layer's output before the target's final norm), while vLLM and SGLang feed "
            "such heads the target's last hidden state after its final norm"
        )
    bad = [k for k in config.capture_indices if not 1 <= k <= n - 1]
    if bad:
        raise ExportError(
            f"capture indices {bad} (of {list(config.capture_indices)}) cannot be served by {reader}: its "
            f"targets record the residual stream entering layer k only for k in 1..N-1 = 1..{n - 1} (k = 0 has "
            f"no residual yet, k = N={n} comes after the layer loop). Retrain the head with capture indices "
            f"in 1..{n - 1}"
        )
    if config.target_hidden_size != config.hidden_size and not head.embed_tokens.owned:
        raise ExportError(
            f"target_hidden_size {config.target_hidden_size} != hidden_size {config.hidden_size}, so the head "
            f"cannot share the target's embedding, yet it carries no embed_tokens.weight of its own; {reader} "
            "would run it with a table of the wrong width"
        )


def _check_sglang(head: EagleDraftModel, config) -> None:
    unread = {
        "norm_before_residual": "its input layer always takes the un-normalised hidden state as the residual",
        "norm_before_fc": "it has no input_norm and skips input_norm.weight without a word",
    }
    for flag, why in unread.items():
        if getattr(config, flag):
            raise ExportError(
                f"{flag}=true cannot be exported for SGLang: its LlamaForCausalLMEagle3 never reads {flag} ({why}), "
                f"so it would run this head as if {flag} were false. Export with --format vllm or --format "
                "speculators instead"
            )
    if head.embed_tokens.owned and config.target_hidden_size == config.hidden_size:
        raise ExportError(
            "this head carries its own embed_tokens.weight, but SGLang replaces an EAGLE-3 draft's embedding "
            "with the target's when their widths agree; export with --format vllm or --format speculators, "
            "which load the head's own table"
        )


def _check_speculators(config) -> None:
    if config.target_hidden_size != config.hidden_size:
        raise ExportError(
            f"target_hidden_size {config.target_hidden_size} != hidden_size {config.hidden_size} cannot be "
            "exported in the speculators format: speculators sizes fc and fc_norm from the draft's hidden size. "
            "Export with --format vllm instead"
        )

