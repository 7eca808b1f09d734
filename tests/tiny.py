"""Tiny random targets, test drafters and a character-level tokenizer shared by the tests (float64 by default:
argmax ties cannot flip)."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from eagle_compile.draft.config import DraftConfig
from eagle_compile.draft.model import EagleDraftModel
from eagle_compile.draft.vocab import build_vocab_mapping

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
_CLASSES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


def tiny_target(arch: str = "llama", *, seed: int = 0, vocab: int = 96, layers: int = 8,
                dtype: torch.dtype = torch.float64, **config):
    """An 8-layer random decoder (default capture indices (2, 4, 5)), GQA 4/2 heads, head_dim 8, a 512-token
    window; `config` overrides any config field (max_position_embeddings, rope_parameters, sliding_window, ...)."""
    cfg_cls, model_cls = _CLASSES[arch]
    fields = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  attn_implementation="sdpa")
    cfg = cfg_cls(**{**fields, **config})
    torch.manual_seed(seed)
    model = model_cls(cfg).to(dtype).eval()
    # Random init gives near-uniform logits; sharpen the head so greedy text has structure and ties are rare.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def greedy_reference(model, input_ids, attention_mask=None, max_new_tokens=16, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                              do_sample=False, **kwargs)


class ScriptedDrafter:
    """A `Drafter` that ignores features and proposes from a known continuation of each row.

    `mode="oracle"` proposes the target's own greedy next token (best first); `mode="adversarial"` never
    proposes it; with `right_from`, an adversarial drafter turns oracle for tokens at index >= right_from of
    the row's full sequence. A draft input at position p predicts the token at index p + 2 of the row's full
    sequence.
    """

    def __init__(self, continuations: list[list[int]], vocab: int, mode: str = "oracle",
                 right_from: int | None = None) -> None:
        self.continuations = continuations
        self.draft_vocab_size = vocab
        self.mode = mode
        self.right_from = right_from
        self.capture_indices = None

    def new_state(self, batch, slots, *, dtype, device):
        return None

    def fill(self, state, hidden, tokens, positions, write_slots):
        return None                    # no KV: proposals come from the continuation, not from draft state

    def forward(self, state, hidden, tokens, positions, write_slots, mask, *, fuse):
        batch, t = tokens.shape
        rows = torch.arange(batch)[:, None].expand(batch, t)
        head = torch.stack([rows, positions], -1).to(torch.float64)     # [B, T, 2]
        return head, head

    def top_k(self, head, k):
        scores, ids = torch.topk(self._log_probs(head), k, dim=-1)
        return scores, ids

    def _log_probs(self, head):
        rows, pos = head[..., 0].long(), head[..., 1].long()
        want = torch.zeros_like(pos)
        for idx in range(rows.numel()):
            r, p = int(rows.view(-1)[idx]), int(pos.view(-1)[idx]) + 2
            seq = self.continuations[r] if r < len(self.continuations) else []
            want.view(-1)[idx] = seq[p] if p < len(seq) else 0
        ids = torch.arange(self.draft_vocab_size)
        right = -((ids - want[..., None]) % self.draft_vocab_size).double()
        wrong = torch.where(ids == want[..., None], -1e4, -(ids.double() % 7))
        if self.mode == "oracle":
            return torch.log_softmax(right, -1)
        if self.right_from is None:
            return torch.log_softmax(wrong, -1)
        late = (pos + 2 >= self.right_from)[..., None]
        return torch.log_softmax(torch.where(late, right, wrong), -1)


def random_head(target, *, flags: bool, seed: int, reduced: bool, **config) -> EagleDraftModel:
    """A random-weight EAGLE-3 (or 3.1 with `flags`) head for `target`, optionally with a reduced vocabulary;
    `config` overrides `DraftConfig` fields (max_position_embeddings, rope_scaling, capture_indices, ...)."""
    vocab = target.config.vocab_size
    cfg = DraftConfig.for_target(target.config, 48 if reduced else vocab,
                                 **({"fc_norm": True, "norm_output": True} if flags else {}), **config)
    torch.manual_seed(seed)
    head = EagleDraftModel(cfg).to(torch.float64).eval()
    if reduced:
        counts = torch.randint(0, 1000, (vocab,), generator=torch.Generator().manual_seed(seed))
        d2t, t2d = build_vocab_mapping(counts, 48)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    head.tie_target_embedding(target)
    return head


def ragged(lengths: list[int], seed: int, vocab: int = 96):
    """Left-padded rows of the given lengths (random ids >= 3) and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


def ragged_batch(rows: int, seed: int):
    """1 row of 7 tokens, or 3 left-padded rows of 3, 12 and 7 tokens."""
    return ragged([7] if rows == 1 else [3, 12, 7], seed)


def force_costs(monkeypatch, relative: dict[str, float] | None = None, **settings) -> None:
    """Make the calibration layer use these relative cycle costs (default: every program as cheap as a plain
    step, so speculation always looks worth it) instead of measuring, and these `CalibrationSettings`."""
    import eagle_compile.runtime.calibration as calibration

    def ensure_costs(self, longest, state, cache, draft_kv, sampling):
        self._costs = {e.name: 1.0 for e in self.menu} if relative is None else dict(relative)

    monkeypatch.setattr(calibration.Calibration, "ensure_costs", ensure_costs)
    if settings:
        base = calibration.CalibrationSettings
        monkeypatch.setattr(calibration, "CalibrationSettings", lambda: base(**settings))


def continuations(ids: torch.Tensor, mask: torch.Tensor, ref: torch.Tensor) -> list[list[int]]:
    """Each row's unpadded prompt followed by its reference continuation (what a ScriptedDrafter reads)."""
    width = ids.shape[1]
    return [[t for t, m in zip(ids[i].tolist(), mask[i].tolist(), strict=True) if m] + ref[i, width:].tolist()
            for i in range(ids.shape[0])]


def rotate_programs(monkeypatch, order: list[int] | None = None) -> None:
    """Make the calibration policy run its menu's programs in turn (entry indices `order`, default all, the
    plain step first), every row drafting: each program size and the re-sync after plain steps get exercised."""
    import eagle_compile.calibrate.policy as policy
    import eagle_compile.runtime.calibration as calibration

    count = [0]

    def decide(self, costs, est, active, matched=None):
        picks = order if order is not None else list(range(len(self.menu)))
        entry = self.menu[picks[count[0] % len(picks)]]
        count[0] += 1
        self.stats.chosen[entry.name] += 1
        return policy.Decision(entry=entry, drafting=active.clone(), probe=False, rates={})

    monkeypatch.setattr(policy.CalibrationPolicy, "decide", decide)
    monkeypatch.setattr(calibration.Calibration, "ensure_costs", lambda self, *args: None)


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 \n.,?!:=+-*/()#"


def tiny_tokenizer():
    """A character-level fast tokenizer with ChatML special tokens (ids 0-3) and a ChatML chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_SPECIALS + list(_CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHATML
    return fast


def save_tiny_folder(path, tokenizer, *, seed: int = 0):
    """`tiny_target` in float32 for `tokenizer` (vocab = len(tokenizer)), saved with the tokenizer as an HF
    folder: what tests of command-line tools and examples pass as `--target`. Returns the model."""
    model = tiny_target("llama", seed=seed, vocab=len(tokenizer), dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def save_random_head(path, target, *, seed: int = 0) -> None:
    """A random EAGLE 3.1 head for `target` (full vocabulary) in the official layout at `path`."""
    from eagle_compile.draft.checkpoint import save_draft
    from eagle_compile.draft.model import untrained_head

    save_draft(untrained_head(target, seed=seed), path)
