"""What a call does at positions past a window: the target's, the draft head's, a sliding window, a RoPE limit.

The lossless contract is `model.generate`'s tokens, so past each window we do what HF does, exactly, or refuse
before any work with the lengths and the fix. Measured on transformers 5.24 (tests/runtime/test_long_context.py):

* **The target's `max_position_embeddings`.** HF's `generate` runs past it (RoPE of positions it was not trained
  on; `MaxLengthCriteria` only logs "exceeded the model's predefined maximum length"). For RoPE whose
  frequencies are fixed (`default`, `linear`, `llama3`, `yarn`, ...) the slot cache and the captured programs
  compute exactly what HF computes at every position, so we run past it too and give HF's tokens; the
  statistics carry a note (and a warning, once per decoder), because the text past the window is the model's
  extrapolation, whatever decodes it.
* **The draft head's `max_position_embeddings`** (often smaller than the target's: heads are trained on short
  samples). The head keeps drafting with the RoPE of its own config beyond it: every draft token is verified
  by the target, so the output stays exact and only acceptance can drop, which tau shows and which the
  calibration layer answers by drafting less or falling back to plain steps. A note says it happened.
* **RoPE that depends on the forward** (`rope_type` "dynamic", "longrope": transformers recomputes the
  frequencies inside each forward from that forward's largest position). The same token then gets a different
  RoPE depending on how the sequence is cut into forwards (HF's one-shot prefill vs our chunks and trees), so
  no chunked or speculative run can promise HF's tokens once a forward crosses the limit. "longrope" picks its
  short factors below `original_max_position_embeddings`: calls that stay below it (every position any forward
  of the call may use) are exact, longer ones are refused. "dynamic" decides with a data-dependent branch that
  `torch.compile(fullgraph=True)` cannot capture, so a target with it is refused, and a draft head with it
  only runs in the host-loop step (eagerly), not in a captured step program.
* **A sliding window** (Mistral's `sliding_window`, Qwen's sliding layers): HF's attention masks keys more than
  `sliding_window` positions back; `eagle31::tree_attention` sees the whole committed prefix. The two agree
  while every emitted token's logits come from a query less than the window from position 0, i.e. while
  prompt + max_new_tokens <= sliding_window; longer calls are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eagle_compile.errors import OptionsError, UnsupportedGenerationError, UnsupportedModelError

#: RoPE types whose frequencies transformers recomputes per forward from the forward's largest position
FORWARD_DEPENDENT_ROPE = ("dynamic", "longrope")


def rope_types(config: Any) -> set[str]:
    """The RoPE types of an HF config (transformers 5 `rope_parameters`, one dict or one per layer type; legacy
    `rope_scaling`), or of a `DraftConfig` (`rope_scaling`); "default" when none is set."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, Mapping):
        return {"default"}
    per_layer_type = [p for p in params.values() if isinstance(p, Mapping)]
    return {p.get("rope_type") or p.get("type") or "default" for p in (per_layer_type or [params])}


def _rope_limit(config: Any) -> int | None:
    """`original_max_position_embeddings` of a longrope config: where it switches from short to long factors."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    limit = params.get("original_max_position_embeddings") if isinstance(params, Mapping) else None
    return int(limit or getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings)


def _sliding_window(config: Any) -> int | None:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)


@dataclass(frozen=True)
class ContextWindow:
    """The windows of one target (and draft head) and what a call past each of them does (module docstring)."""

    target: int | None                 # the target's max_position_embeddings
    draft: int | None                  # the head's max_position_embeddings (None: no head, or it does not say)
    sliding: int | None                # the target's sliding window (None: full attention in every layer)
    rope_limit: int | None             # longrope's original_max_position_embeddings (None: static RoPE)
    draft_rope: str = "default"

    @classmethod
    def of(cls, model, draft_config: Any | None, *, step_program: bool) -> ContextWindow:
        """Read the windows; refuse what no call can decode exactly (a target with "dynamic" RoPE) or what the
        options cannot run (a head with "dynamic" RoPE in a captured step program)."""
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        kinds = rope_types(config)
        if "dynamic" in kinds:
            raise UnsupportedModelError(
                f"the target's RoPE is rope_type 'dynamic' (dynamic NTK scaling, max_position_embeddings "
                f"{config.max_position_embeddings}): transformers recomputes its frequencies inside each forward "
                "from that forward's largest position, a data-dependent branch torch.compile(fullgraph=True) cannot "
                "capture, and past the window the result depends on how the sequence is cut into forwards, so no "
                "speculative run can promise model.generate's tokens. Supported: RoPE with fixed frequencies "
                "('default', 'linear', 'llama3', 'yarn', ...; 'longrope' below its original window). Decode this "
                "model with model.generate")
        draft_rope = "default"
        if draft_config is not None:
            draft_kinds = rope_types(draft_config)
            draft_rope = ",".join(sorted(draft_kinds))
            if "dynamic" in draft_kinds and step_program:
                raise OptionsError(
                    "the draft head's RoPE is rope_type 'dynamic': its frequencies are recomputed inside each "
                    "forward by a data-dependent branch, which a captured step program (step_program=True) cannot "
                    "hold. Use step_program=False (the host-loop step runs the head eagerly; the output stays "
                    "exact) or a head with fixed RoPE frequencies")
        return cls(target=getattr(config, "max_position_embeddings", None),
                   draft=getattr(draft_config, "max_position_embeddings", None),
                   sliding=_sliding_window(config),
                   rope_limit=_rope_limit(config) if "longrope" in kinds else None,
                   draft_rope=draft_rope)

    def check(self, longest_prompt: int, max_new_tokens: int, reach: int) -> None:
        """Refuse a call whose tokens could differ from model.generate's. `reach`: one past the largest position
        any forward of the call may use (committed tokens plus what a cycle writes past them)."""
        total = longest_prompt + max_new_tokens
        if self.sliding is not None and total > self.sliding:
            raise UnsupportedGenerationError(
                f"the longest prompt ({longest_prompt} tokens) + max_new_tokens ({max_new_tokens}) = {total} is "
                f"longer than the target's sliding window ({self.sliding}): past it HF's attention drops keys more "
                f"than {self.sliding} positions back, which eagle31's attention does not, so the tokens would "
                f"differ from model.generate's. Keep prompt + max_new_tokens <= {self.sliding}, or decode with "
                "model.generate")
        if self.rope_limit is not None and reach > self.rope_limit:
            raise UnsupportedGenerationError(
                f"the target's RoPE is 'longrope' with original_max_position_embeddings {self.rope_limit}: a "
                f"forward whose positions pass it switches every position of that forward to the long factors, so "
                f"the tokens depend on how the sequence is cut into forwards. This call (longest prompt "
                f"{longest_prompt} + max_new_tokens {max_new_tokens}, forwards reaching position {reach - 1}) "
                f"passes it; keep prompt + max_new_tokens + the tree's reach ({reach - total}) <= "
                f"{self.rope_limit}, or decode with model.generate")

    def notes(self, longest_sequence: int, drafted: bool) -> dict[str, str]:
        """Notes (by kind) for a call whose longest row reached `longest_sequence` tokens; `drafted`: the head
        ran in this call."""
        out = {}
        if self.target is not None and longest_sequence > self.target:
            out["target window"] = (
                f"the longest row reached {longest_sequence} tokens, past the target's max_position_embeddings "
                f"({self.target}): decoded exactly as model.generate does (which runs past it too), so the text "
                "past the window is the model's RoPE extrapolation")
        if drafted and self.draft is not None and longest_sequence > self.draft:
            out["draft window"] = (
                f"the longest row reached {longest_sequence} tokens, past the draft head's max_position_embeddings "
                f"({self.draft}): the head kept drafting with its own RoPE ({self.draft_rope}) beyond the positions "
                "it was trained on; the output stays exact (the target verifies every draft token), acceptance "
                "may be lower (see tau)")
        return out
