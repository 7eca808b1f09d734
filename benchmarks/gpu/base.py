"""What every section of the GPU check shares: the run's bookkeeping and clock, random targets and heads, byte
counts, and the guard around one sub-step."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

#: the Llama-3.1-8B shape (random weights in every section that builds it)
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                max_position_embeddings=131072, rms_norm_eps=1e-5)


# -- bookkeeping ---------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """What one invocation checks and measures, and its clock."""

    device: torch.device
    mode: str                      # "gpu" or "dry"
    budget_s: float
    t0: float = field(default_factory=time.perf_counter)
    checks: list[dict] = field(default_factory=list)
    rows: dict[str, list[dict]] = field(default_factory=lambda: {k: [] for k in ("a", "b", "c", "l", "n", "t")})
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    section_s: dict[str, float] = field(default_factory=dict)
    negative_control: bool = False
    keep: dict[str, Any] = field(default_factory=dict)   # objects shared between sections (the (b) target)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def time_left(self, what: str, need_s: float = 0.0) -> bool:
        """False (and the step is listed as skipped) when `what` would start past the budget."""
        if self.elapsed() + need_s <= self.budget_s:
            return True
        self.skipped.append(what)
        log(self, f"SKIPPED (time budget {self.budget_s:.0f} s): {what}")
        return False

    def check(self, section: str, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append({"section": section, "name": name, "ok": bool(ok), "detail": detail})
        log(self, f"{'PASS' if ok else 'FAIL'} ({section}) {name}{': ' + detail if detail else ''}")
        return ok

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
            log(self, f"NOTE: {text}")

    @property
    def failed(self) -> list[dict]:
        return [c for c in self.checks if not c["ok"]]


def log(run: Run, msg: str) -> None:
    print(f"[+{run.elapsed():6.1f}s {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def guarded(run: Run, section: str, label: str, fn: Callable[[], None]) -> None:
    """One sub-step: a crash fails it and the next one runs, unless the crash broke CUDA for the process."""
    try:
        fn()
    except Exception as e:
        traceback.print_exc()
        run.check(section, f"{label} ran", False, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
        if run.cuda and "CUDA" in str(e):
            raise
    free_memory(run)


def free_memory(run: Run) -> None:
    import gc

    gc.collect()
    if run.cuda:
        torch.cuda.empty_cache()


# -- shared: random targets and heads ------------------------------------------------------------------------------
def build_target(shape: dict, dtype: torch.dtype, device: torch.device, seed: int, *, sharpen: float = 1.0):
    """A random-weight Llama built directly on `device` (an 8B one takes seconds on a GPU, minutes on a CPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, tie_word_embeddings=False, attn_implementation="sdpa", bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model = model.to(dtype).eval()
    if sharpen != 1.0:          # random init gives near-uniform logits: sharpen so greedy text has few near ties
        with torch.no_grad():
            model.lm_head.weight.mul_(sharpen)
    model.generation_config.eos_token_id = None      # every row runs to max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


def build_head(model, draft_vocab: int, seed: int, capture_indices: tuple[int, ...] | None = None):
    """A random EAGLE 3.1 head (fc_norm, norm_output) with a reduced draft vocabulary, on the model's device."""
    from eagle_compile.draft.config import DraftConfig
    from eagle_compile.draft.model import EagleDraftModel
    from eagle_compile.draft.vocab import build_vocab_mapping

    param = next(model.parameters())
    extra = {"capture_indices": capture_indices} if capture_indices else {}
    config = DraftConfig.for_target(model.config, draft_vocab, fc_norm=True, norm_output=True, **extra)
    torch.manual_seed(seed)
    with torch.device(param.device):
        head = EagleDraftModel(config)
    head = head.to(param.dtype).eval()
    counts = torch.randint(0, 1000, (model.config.vocab_size,), generator=torch.Generator().manual_seed(seed))
    d2t, t2d = build_vocab_mapping(counts, draft_vocab)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    head.tie_target_embedding(model)
    return head


# -- bytes ---------------------------------------------------------------------------------------------------------
def weight_bytes(module: torch.nn.Module, skip: tuple[str, ...] = ()) -> int:
    return sum(p.numel() * p.element_size() for name, p in module.named_parameters()
               if not any(name.startswith(s) or f".{s}" in name for s in skip))


def kv_bytes(config, batch: int, tokens: float, element: int) -> float:
    """Bytes of K and V over `tokens` positions for all layers of a target (or one draft layer)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(c, "num_hidden_layers", 1)
    return 2 * layers * batch * c.num_key_value_heads * c.head_dim * tokens * element


# -- where two greedy outputs part ---------------------------------------------------------------------------------
def top2_margin(model, ids: torch.Tensor) -> tuple[float, float]:
    """(top-1 minus top-2 logit, |top-1 logit|) of the target's next token after `ids` [1, L] (one forward,
    the lm_head at the last position only, so it works at 128K tokens)."""
    with torch.no_grad():
        logits = model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1]), float(top[0].abs())


def divergence(model, ours: torch.Tensor, hf: torch.Tensor, mask: torch.Tensor) -> str:
    """Where our output leaves HF's, and the target's top-2 logit margin there (a near tie is rounding)."""
    diff = (ours != hf).nonzero()
    row, col = (int(x) for x in diff[0])
    start = int(mask[row].nonzero()[0])
    margin, _ = top2_margin(model, hf[row:row + 1, start:col])
    return (f"row {row}, column {col}: ours {int(ours[row, col])}, HF {int(hf[row, col])}; top-2 logit margin "
            f"there {margin:.3g} ({'near tie' if margin < 1e-2 else 'NOT a near tie'})")
