"""`eagle_compile.generate`: speculative decoding with Hugging Face `generate` semantics.

Three doors lead here, all to the same function:

* `eagle_compile.generate(model, input_ids, draft=..., **generation_kwargs)`;
* `model.generate(input_ids, custom_generate=eagle_compile.generate, draft=..., ...)`: transformers prepares
  the generation config, logits processors and stopping criteria, then calls us in place of its decoding loop
  (our extra parameters, e.g. `draft` and `options`, are routed to us because they are in our signature);
* `torch.compile(model, backend="eagle31", options={...}).generate(...)`: see `eagle_compile.backend`.

What comes back is what HF returns: the input ids (padding kept) followed by the new tokens, finished rows
padded with `pad_token_id`; with `return_dict_in_generate=True` an `EagleGenerateOutput` that also carries the
output attention mask and the statistics.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation import (
    EosTokenCriteria,
    LogitsProcessorList,
    MaxLengthCriteria,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    StopStringCriteria,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from eagle_compile.calibrate.costs import CostCache, default_cache_dir
from eagle_compile.calibrate.menu import default_menu
from eagle_compile.core.tree import TreeShape
from eagle_compile.draft.drafter import Drafter, EagleDrafter
from eagle_compile.draft.tree_file import head_tree
from eagle_compile.errors import UnsupportedGenerationError
from eagle_compile.options import EagleOptions, parse_options
from eagle_compile.runtime.decoder import SpeculativeDecoder
from eagle_compile.runtime.decoder_registry import DecoderRegistry
from eagle_compile.runtime.sampling import SamplingParams
from eagle_compile.runtime.stats import GenerationStats
from eagle_compile.runtime.stopping import StopChecker

_IMPLIED_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
# the processors HF builds from these generation settings; `runtime/logits_processors.py` applies them per node
_CONFIG_PROCESSORS = {
    SequenceBiasLogitsProcessor: "sequence_bias", RepetitionPenaltyLogitsProcessor: "repetition_penalty",
    NoRepeatNGramLogitsProcessor: "no_repeat_ngram_size", NoBadWordsLogitsProcessor: "bad_words_ids",
    MinLengthLogitsProcessor: "min_length", MinNewTokensLengthLogitsProcessor: "min_new_tokens",
    SuppressTokensLogitsProcessor: "suppress_tokens", SuppressTokensAtBeginLogitsProcessor: "begin_suppress_tokens",
}
_NATIVE_CRITERIA = (MaxLengthCriteria, EosTokenCriteria)
_UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
_decoders = DecoderRegistry()        # per model, kept on the model (decoder_registry.py says why)


@dataclass
class EagleGenerateOutput(GenerateDecoderOnlyOutput):
    """HF's decoder-only output plus the attention mask of `sequences` and the speculative statistics."""

    attention_mask: torch.Tensor | None = None
    stats: GenerationStats | None = None


def generate(model, input_ids: torch.Tensor | None = None, logits_processor=None, stopping_criteria=None,
             generation_config: GenerationConfig | None = None, *, draft: Any = None, options: Any = None,
             tokenizer=None, generator: torch.Generator | None = None, **kwargs):
    """Speculative generation, lossless with respect to `model.generate` (same tokens when greedy, same
    distribution when sampling).

    Args:
        model: a Hugging Face decoder-only causal LM (Llama, Qwen2, Qwen3, Mistral, SmolLM), or the module that
            `torch.compile(model, backend="eagle31")` returned.
        input_ids: [B, L] prompt ids; with `attention_mask` [B, L] for a padded (left or right) batch.
        draft: an EAGLE-3 / EAGLE 3.1 checkpoint folder, an `EagleDraftModel`, or any `Drafter`
            (defaults to `options["draft"]`).
        options: `EagleOptions` or its dict (tree shape, buckets, ...).
        tokenizer: needed for `stop_strings`.
        generator: torch.Generator for sampling (default: torch's global RNG, like HF).
        **kwargs: generation settings (max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id,
            stop_strings, return_dict_in_generate, attention_mask, streamer, ...). A `streamer` (HF
            `BaseStreamer`, batch size 1) gets the prompt, then each cycle's kept tokens, then `end()`.
    """
    model = getattr(model, "_orig_mod", model)
    opts = parse_options(options)
    attention_mask = kwargs.pop("attention_mask", None)
    streamer = kwargs.pop("streamer", None)
    for prepared_by_hf in ("use_cache", "logits_to_keep", "cache", "past_key_values", "synced_gpus", "position_ids"):
        kwargs.pop(prepared_by_hf, None)   # HF's own cache plumbing; we run on our static caches
    from_hf = generation_config is not None and stopping_criteria is not None
    if not from_hf:
        generation_config, kwargs = _generation_config(model, generation_config, kwargs)
    if kwargs:
        raise UnsupportedGenerationError(
            f"unknown or unsupported generation argument(s) {sorted(kwargs)}; eagle_compile.generate takes "
            "HF generation settings (max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id, "
            "stop_strings, ...) plus draft=, options=, tokenizer=, generator="
        )
    _refuse_unsupported_outputs(generation_config)
    sampling = SamplingParams.from_generation_config(generation_config)
    _check_processors(logits_processor, sampling)
    prompts, attention_mask = _split_rows(model, input_ids, attention_mask)
    stopper = _stopper(model, prompts, input_ids.shape[1], generation_config, stopping_criteria, tokenizer,
                       streamer)
    decoder = decoder_for(model, draft if draft is not None else opts.draft, opts)
    if streamer is not None:
        streamer.put(input_ids.cpu())          # the prompt first, as HF's generate does
    stats = decoder.generate(prompts, stopper, sampling, generator, inputs=(input_ids, attention_mask))
    if streamer is not None:
        streamer.end()
    return _assemble(input_ids, attention_mask, stopper, generation_config, stats)


# -- configuration -----------------------------------------------------------------------------------------------
def _generation_config(model, generation_config, kwargs):
    base = copy.deepcopy(generation_config or model.generation_config)
    unused = base.update(**kwargs)
    base.validate()
    return base, unused


def _refuse_unsupported_outputs(gc: GenerationConfig) -> None:
    if (gc.num_return_sequences or 1) > 1:
        raise UnsupportedGenerationError(f"num_return_sequences={gc.num_return_sequences} is not supported; repeat "
                                         "the prompt rows instead (rows are independent)")
    asked = [k for k in _UNSUPPORTED_OUTPUTS if getattr(gc, k, False)]
    if asked:
        raise UnsupportedGenerationError(f"{asked} are not produced by speculative decoding; drop them "
                                         "(return_dict_in_generate=True gives sequences, attention_mask and stats)")


def _check_processors(logits_processor, sampling: SamplingParams) -> None:
    """HF hands us the processors it built from the generation config, which `SamplingParams` reproduces (the
    warpers, and the history-reading processors per tree node); a processor the config does not imply (one the
    caller built) is not applied here, so we refuse it rather than drop it."""
    configured = sampling.processors.configured() if sampling.processors is not None else set()
    if "min_new_tokens" in configured:
        # HF's _prepare_generated_length turns min_new_tokens into min_length = prompt length + min_new_tokens
        # and hands us a MinLengthLogitsProcessor for it: the same rule, which ProcessorSettings keeps as min_new_tokens
        configured.add("min_length")
    for proc in logits_processor or LogitsProcessorList():
        if isinstance(proc, _IMPLIED_PROCESSORS) or _CONFIG_PROCESSORS.get(type(proc)) in configured:
            continue
        setting = _CONFIG_PROCESSORS.get(type(proc))
        fix = (f"set {setting}=... as a generation setting instead (eagle_compile applies it per tree node)"
               if setting else "remove it or decode with plain model.generate")
        raise UnsupportedGenerationError(
            f"logits processor {type(proc).__name__} passed in logits_processor= is not supported by speculative "
            f"decoding (only the ones generation settings imply: temperature, top_k, top_p, "
            f"{', '.join(_CONFIG_PROCESSORS.values())}); {fix}"
        )


def _split_rows(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
    """Each row's unpadded prompt, once the ids and the mask are known to be ones the programs can run.

    Refused here, before any program runs: an id outside the target's embedding table fails deep inside the
    captured forward (an IndexError on CPU, a device-side assert that ends the CUDA context on a GPU), and
    float or bool ids would be silently cast (`.long()` rounds 3.7 to 3, reads True as 1). Ids under
    attention_mask 0 are never read, so padding may hold any id (-1, -100, ...).
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or 0 in input_ids.shape:
        seen = f"shape {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else repr(input_ids)
        raise ValueError(f"input_ids must be a non-empty [batch, length] tensor of token ids, got {seen}; for one "
                         "prompt of shape [length] pass input_ids[None] (tokenizers give [1, length] with "
                         "return_tensors='pt')")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids has dtype {input_ids.dtype}; token ids must be an integer tensor (torch.long, "
                         "as tokenizers return them): pass the tokenizer's ids, not embeddings, scores or a mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} differs from input_ids "
                         f"{tuple(input_ids.shape)}; pass the mask the tokenizer returned with these ids")
    _check_vocabulary(model, input_ids, attention_mask.bool())
    prompts = []
    for b, (row, m) in enumerate(zip(input_ids, attention_mask, strict=True)):
        keep = m.bool()
        idx = keep.nonzero()[:, 0]
        if idx.numel() == 0:
            raise ValueError(f"row {b} has an all-zero attention_mask (an empty prompt); drop the row or give it "
                             "at least one token")
        if int(idx[-1] - idx[0] + 1) != idx.numel():
            raise ValueError(f"attention_mask row {b} has holes; only left or right padding is supported")
        prompts.append(row[keep].long())
    return prompts, attention_mask


def _check_vocabulary(model, input_ids: torch.Tensor, live: torch.Tensor) -> None:
    """Refuse ids outside [0, V) at positions the mask keeps (V: rows of the target's input embedding)."""
    embedding = model.get_input_embeddings()
    vocab = embedding.num_embeddings if embedding is not None else model.config.get_text_config().vocab_size
    bad = live & ((input_ids < 0) | (input_ids >= vocab))
    if not bool(bad.any()):                     # one host read for the whole batch
        return
    rows, cols = bad.nonzero(as_tuple=True)
    b, i = int(rows[0]), int(cols[0])
    others = f" ({len(rows)} such ids, in rows {sorted(set(rows.tolist()))})" if len(rows) > 1 else ""
    raise ValueError(f"input_ids[{b}, {i}] = {int(input_ids[b, i])} (row {b}, position {i}) is not a token id of "
                     f"this target: its vocabulary is [0, {vocab}){others}. Tokenize with the target's own "
                     "tokenizer; padding may hold any id where attention_mask is 0")


def _stopper(model, prompts, padded_len, gc: GenerationConfig, stopping_criteria, tokenizer,
             streamer=None) -> StopChecker:
    max_new = _max_new_tokens(model, gc, padded_len)
    eos = gc.eos_token_id
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    criteria = [c for c in (stopping_criteria or []) if not isinstance(c, _NATIVE_CRITERIA)]
    if gc.stop_strings and not any(isinstance(c, StopStringCriteria) for c in criteria):
        if tokenizer is None:
            raise UnsupportedGenerationError("stop_strings needs the tokenizer: pass tokenizer=...")
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=gc.stop_strings))
    return StopChecker(prompts, max_new_tokens=max_new, eos_token_ids=eos, criteria=criteria, streamer=streamer)


def _max_new_tokens(model, gc: GenerationConfig, padded_len: int) -> int:
    """`max_new_tokens`, else `max_length` minus the padded prompt, else HF's default: 20 new tokens, with the
    total capped at the target's max_position_embeddings (`GenerationMixin._prepare_generated_length`)."""
    if gc.max_new_tokens is not None:
        return gc.max_new_tokens
    if gc.max_length is not None:
        max_length, why = gc.max_length, "max_length"
    else:
        max_length = GenerationConfig._get_default_generation_params()["max_length"] + padded_len
        window = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        max_length = min(max_length, window) if window is not None else max_length
        why = ("max_length (HF's default when neither max_new_tokens nor max_length is given: the prompt + 20, "
               "capped at the target's max_position_embeddings)")
    if padded_len >= max_length:
        raise ValueError(f"input_ids has {padded_len} tokens but {why} is {max_length}: nothing to generate; pass "
                         "max_new_tokens")
    return max_length - padded_len


# -- draft and decoder ------------------------------------------------------------------------------------------
def decoder_for(model, draft, opts: EagleOptions) -> SpeculativeDecoder:
    """The decoder of (model, draft, options), built on first use and kept per model: `generate` and the server
    (`eagle_compile.serve.engine`) share it, so its captured programs and measured costs serve both."""
    if draft is None and opts.speculate:
        raise UnsupportedGenerationError(
            "no draft head: pass draft= (an EAGLE-3/3.1 checkpoint folder or EagleDraftModel) or "
            "options={'draft': ...}; or options={'speculate': False} for plain decoding"
        )
    per_model = _decoders.setdefault(model)
    key = (_draft_key(draft), tuple(sorted((k, repr(v)) for k, v in opts.as_dict().items() if k != "draft")))
    if key not in per_model:
        drafter, indices = _drafter(model, draft) if draft is not None else (None, None)
        shape, source = _tree_shape(model, draft, opts)
        menu, why = _menu(opts, shape, source)
        if menu is None and opts.speculate and opts.copy_length:        # a fixed tree: the copy branch joins it
            shape = dataclasses.replace(shape, copy=opts.copy_length)
        per_model[key] = SpeculativeDecoder(model, drafter, opts, indices, shape, source, menu=menu,
                                            cost_cache=_cost_cache(opts), calibration_reason=why)
    return per_model[key]


def _menu(opts: EagleOptions, shape: TreeShape, source: str) -> tuple[tuple | None, str]:
    """The calibration menu (None: a fixed tree) and why."""
    if not opts.speculate:
        return None, "speculate=False"
    if opts.calibrate == "off":
        return None, "fixed tree: calibrate='off'"
    if opts.calibrate == "auto" and opts.tree_given:
        return None, ("fixed tree: a tree key was given in the options (calibrate='auto' keeps it; "
                      "calibrate='on' adapts around it)")
    if opts.calibrate == "auto" and opts.cudagraphs:
        return None, "fixed tree: cudagraphs=True (the menu's programs are not CUDA-graphed yet)"
    menu = default_menu(shape, copy=opts.calibrated_copy)
    return menu, (f"adaptive (calibrate={opts.calibrate!r}): menu {[e.name for e in menu]}, "
                  f"largest tree from {source}")


def _cost_cache(opts: EagleOptions) -> CostCache:
    if opts.calibration_cache == "memory":
        return CostCache(None)
    return CostCache(opts.calibration_cache or default_cache_dir())


def _draft_key(draft) -> Any:
    return str(Path(draft).resolve()) if isinstance(draft, (str, Path)) else id(draft)


def _tree_shape(model, draft, opts: EagleOptions) -> tuple[TreeShape, str]:
    """The tree shape and where it came from: the options' tree keys, else the tree.json beside the head when
    it was chosen for this device kind and dtype, else the official EAGLE defaults."""
    if opts.tree_given:
        return TreeShape(opts.tree_depth, opts.tree_top_k, opts.tree_tokens), "options"
    param = next(model.parameters())
    folder = Path(draft) if isinstance(draft, (str, Path)) else getattr(draft, "source_dir", None)
    tree, why = head_tree(folder, param.device, param.dtype)
    if tree is None:
        return (TreeShape(opts.tree_depth, opts.tree_top_k, opts.tree_tokens),
                f"EAGLE defaults (no tree key in the options; {why})")
    chosen = opts.replace(**tree)
    return TreeShape(chosen.tree_depth, chosen.tree_top_k, chosen.tree_tokens), why


def _drafter(model, draft) -> tuple[Drafter, tuple[int, ...] | None]:
    from eagle_compile.draft.checkpoint import check_target_config, load_draft

    if isinstance(draft, (str, Path)):
        dtype = next(model.parameters()).dtype
        draft = load_draft(draft, target=model, dtype=dtype, device=next(model.parameters()).device)
    if hasattr(draft, "new_state") and hasattr(draft, "top_k"):
        return draft, getattr(draft, "capture_indices", None)
    where = getattr(draft, "source_dir", None) or f"the {type(draft).__name__} given as draft="
    check_target_config(draft.config, model.config.get_text_config(), where)
    if draft.embed_tokens.weight is None:
        draft.tie_target_embedding(model)      # EAGLE-3 heads share the target's (frozen) embedding table
    head = EagleDrafter(draft)
    return head, tuple(draft.config.capture_indices) if draft.config.capture_indices is not None else None


# -- output ------------------------------------------------------------------------------------------------------
def _assemble(input_ids, attention_mask, stopper: StopChecker, gc: GenerationConfig, stats: GenerationStats):
    pad = gc.pad_token_id
    if pad is None:
        eos = gc.eos_token_id
        pad = eos if isinstance(eos, int) else (eos[0] if eos else 0)
    width = max(len(g) for g in stopper.generated)
    batch = input_ids.shape[0]
    new = torch.full((batch, width), int(pad), dtype=input_ids.dtype, device=input_ids.device)
    new_mask = torch.zeros((batch, width), dtype=attention_mask.dtype, device=input_ids.device)
    for b, g in enumerate(stopper.generated):
        new[b, :len(g)] = torch.tensor(g, dtype=input_ids.dtype)
        new_mask[b, :len(g)] = 1
    sequences = torch.cat([input_ids, new], 1)
    if gc.return_dict_in_generate:
        return EagleGenerateOutput(sequences=sequences, attention_mask=torch.cat([attention_mask, new_mask], 1),
                                   stats=stats)
    return sequences
