"""The draft head's configuration: one frozen dataclass, read from and written to both checkpoint layouts.

EAGLE31_SPEC.md §1-§3 and §9 decide every key here. Two layouts exist on disk:

* **official EAGLE-3** (``LlamaForCausalLMEagle3``): a flat Llama ``config.json`` plus ``draft_vocab_size``,
  optional ``target_hidden_size`` and the flags. An absent flag means ``False`` (EAGLE-3 behaviour, §2.4).
* **speculators** (``speculators_model_type: "eagle3"``): the Llama fields live in
  ``transformer_layer_config`` (serialised by speculators with ``to_diff_dict``, so fields equal to the
  ``LlamaConfig`` defaults may be absent); the flags sit at the top level and an absent
  ``norm_before_residual`` means ``True`` there (§2.4, §9.2).

Both readers fill absent Llama fields with the defaults of transformers' ``LlamaConfig`` (what vLLM, SGLang
and speculators get for the same file), so ``rope_theta`` defaults to 10000 (§1.5, §9.5); the one exception is
an official config without ``num_hidden_layers``, which is the one-layer head the official loader builds.

``eagle_aux_hidden_state_layer_ids`` always has capture-index semantics (``eagle_compile.capture_indices``):
it is read top level first, then from a nested ``eagle_config``, and written at the top level only (SGLang
adds +1 to ids it finds in ``eagle_config``, §9.1).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from eagle_compile.capture_indices import CONFIG_KEY, capture_indices_from_config, validate_capture_indices
from eagle_compile.errors import CheckpointError

OFFICIAL_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
FLAGS = ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual")

# Keys of a Llama config.json that decide the draft's shapes and numerics; everything else in a config
# (token ids, dtype, versions) is not needed to run the head.
_LLAMA_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "num_hidden_layers",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "attention_bias",
    "mlp_bias",
)


@dataclass(frozen=True, kw_only=True)
class DraftConfig:
    """Shapes, RoPE and EAGLE 3.1 flags of one EAGLE-3 draft head (a single 2H "midlayer").

    ``head_dim``, ``num_key_value_heads``, ``draft_vocab_size`` and ``target_hidden_size`` may be given as
    ``None`` and are then resolved (``hidden/heads``, ``heads``, ``vocab_size``, ``hidden_size``).
    ``capture_indices`` ``None`` means "the target's default" (``(2, N//2, N-3)``), resolved once the target's
    layer count is known. ``rope_scaling`` is the transformers ``rope_parameters`` dict without
    ``rope_theta`` (``None`` for plain RoPE); treat it as read-only.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    num_hidden_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    hidden_act: str = "silu"
    capture_indices: tuple[int, ...] | None = None
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    use_aux_hidden_state: bool = True

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
            _require_positive_int(name, getattr(self, name))
        if self.num_key_value_heads is None:
            put("num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; give head_dim explicitly"
                )
            put("head_dim", self.hidden_size // self.num_attention_heads)
        if self.draft_vocab_size is None:
            put("draft_vocab_size", self.vocab_size)
        if self.target_hidden_size is None:
            put("target_hidden_size", self.hidden_size)
        for name in ("num_key_value_heads", "head_dim", "draft_vocab_size", "target_hidden_size",
                     "num_hidden_layers", "max_position_embeddings"):
            _require_positive_int(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads "
                f"{self.num_key_value_heads} (grouped-query attention needs whole groups)"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size {self.draft_vocab_size} is larger than the target vocabulary "
                f"vocab_size {self.vocab_size}; the draft vocabulary must be a subset of the target's"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary position embeddings")
        if self.num_hidden_layers != 1:
            raise ValueError(
                f"num_hidden_layers={self.num_hidden_layers}: only single-layer draft heads are supported "
                "(official EAGLE-3 and EAGLE 3.1 heads have exactly one 2H midlayer, and the draft KV cache "
                "holds one layer). Multi-layer speculators/vLLM drafts (extra plain Llama layers) cannot "
                "be loaded."
            )
        if self.hidden_act != "silu":
            raise ValueError(
                f"hidden_act {self.hidden_act!r} is not supported; EAGLE-3 draft heads use the SwiGLU MLP "
                "with 'silu'"
            )
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ValueError(
                f"rms_norm_eps ({self.rms_norm_eps}) and rope_theta ({self.rope_theta}) must be positive"
            )
        put("rms_norm_eps", float(self.rms_norm_eps))
        put("rope_theta", float(self.rope_theta))
        for name in (*FLAGS, "attention_bias", "use_aux_hidden_state"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.fc_norm and self.norm_before_fc:
            raise ValueError(
                "fc_norm and norm_before_fc are both true: that normalises the target features twice "
                "(per feature, then the whole concat). They are mutually exclusive (EAGLE31_SPEC §9.3); "
                "EAGLE 3.1 heads use fc_norm, gpt-oss style heads use norm_before_fc."
            )
        if self.capture_indices is not None:
            indices = tuple(int(i) for i in self.capture_indices)
            if not indices or min(indices) < 0 or len(set(indices)) != len(indices):
                raise ValueError(
                    f"capture_indices {list(indices)} must be a non-empty list of distinct capture indices "
                    ">= 0"
                )
            put("capture_indices", indices)
        if not self.use_aux_hidden_state:
            if self.fc_norm or self.norm_before_fc:
                raise ValueError(
                    "use_aux_hidden_state=false means there is no fc fusion layer, so fc_norm/norm_before_fc "
                    "have nothing to normalise; turn them off"
                )
            if self.target_hidden_size != self.hidden_size:
                raise ValueError(
                    f"use_aux_hidden_state=false feeds the target's hidden state (width "
                    f"{self.target_hidden_size}) straight into the draft (width {self.hidden_size}); they "
                    "must be equal"
                )
            if self.capture_indices is not None and len(self.capture_indices) != 1:
                raise ValueError(
                    f"use_aux_hidden_state=false takes a single target feature, but capture_indices is "
                    f"{list(self.capture_indices)}"
                )
        if self.rope_scaling is not None:
            put("rope_scaling", _normalise_rope_scaling(self.rope_scaling))
        try:
            self.llama_config()
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(
                f"rope_scaling {self.rope_scaling} is not accepted by transformers: {e}"
            ) from e

    def __hash__(self) -> int:
        return hash(json.dumps(dataclasses.asdict(self), sort_keys=True, default=str))

    # ----------------------------------------------------------------------------------------------
    @property
    def num_features(self) -> int:
        """A: how many target features the head fuses (the fc input is ``A * target_hidden_size`` wide)."""
        if self.capture_indices is not None:
            return len(self.capture_indices)
        return 3 if self.use_aux_hidden_state else 1

    def resolved_capture_indices(self, num_target_layers: int) -> tuple[int, ...]:
        """The capture indices for a target with ``num_target_layers`` decoder layers."""
        if self.capture_indices is not None:
            return validate_capture_indices(self.capture_indices, num_target_layers)
        if not self.use_aux_hidden_state:
            return (num_target_layers,)
        return capture_indices_from_config({}, num_target_layers)

    def llama_config(self):
        """A transformers ``LlamaConfig`` with this draft's attention shapes and RoPE (for the rotary)."""
        from transformers import LlamaConfig

        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_hidden_layers=self.num_hidden_layers,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=rope,
            attention_bias=self.attention_bias,
        )

    # ----------------------------------------------------------------------------------------------
    @classmethod
    def for_target(cls, target_config: Any, draft_vocab_size: int | None, **overrides: Any) -> DraftConfig:
        """A one-layer draft config sized like an HF Llama/Qwen2/Qwen3/Mistral target.

        Hidden size, heads, KV heads, head_dim, intermediate size, norm eps, context length and RoPE are
        copied from the target; capture indices default to ``(2, N//2, N-3)``. ``overrides`` set any other
        field (the flags, ``capture_indices``, ...).
        """
        if hasattr(target_config, "get_text_config"):
            target_config = target_config.get_text_config()
        d = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config)
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(
                f"unknown DraftConfig fields {unknown}; valid: {[f.name for f in dataclasses.fields(cls)]}"
            )
        hidden = d["hidden_size"]
        heads = d["num_attention_heads"]
        theta, scaling = _rope_from_dict(d)
        fields: dict[str, Any] = {
            "hidden_size": hidden,
            "intermediate_size": d["intermediate_size"],
            "num_attention_heads": heads,
            "num_key_value_heads": d.get("num_key_value_heads") or heads,
            "head_dim": d.get("head_dim") or hidden // heads,
            "vocab_size": d["vocab_size"],
            "draft_vocab_size": draft_vocab_size,
            "target_hidden_size": hidden,
            "rms_norm_eps": d.get("rms_norm_eps", 1e-6),
            "rope_theta": theta,
            "rope_scaling": scaling,
            "max_position_embeddings": d.get("max_position_embeddings", 2048),
        }
        if "capture_indices" not in overrides:
            layers = d["num_hidden_layers"]
            single = overrides.get("use_aux_hidden_state") is False
            fields["capture_indices"] = (layers,) if single else capture_indices_from_config({}, layers)
        fields.update(overrides)
        return cls(**fields)

    # ----------------------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], num_target_layers: int | None = None) -> DraftConfig:
        """Read an official EAGLE-3 ``config.json`` (``LlamaForCausalLMEagle3``); absent flags are False.

        ``num_target_layers`` resolves (and range-checks) the capture indices; without it, indices stated
        in the config are kept and absent ones stay ``None`` (the target default).
        """
        model_type = d.get("model_type", "llama")
        if model_type != "llama":
            raise CheckpointError(
                f"config.json has model_type {model_type!r}; only Llama-style draft layers (model_type "
                "'llama') are supported"
            )
        for key in ("bias", "mlp_bias"):
            if d.get(key):
                raise CheckpointError(
                    f"config.json sets {key}: true; draft heads with biased fc/MLP layers are not supported"
                )
        fields = _llama_fields(d, "config.json")
        fields["num_hidden_layers"] = _official_layers(d.get("num_hidden_layers"))
        eagle = d.get("eagle_config") if isinstance(d.get("eagle_config"), Mapping) else {}
        flags = {}
        for name in FLAGS:
            top, nested = d.get(name), eagle.get(name)
            if top is not None and nested is not None and bool(top) != bool(nested):
                raise CheckpointError(
                    f"config.json sets {name}={top} at the top level but {name}={nested} in eagle_config; "
                    "make them agree"
                )
            flags[name] = bool(nested if nested is not None else (top if top is not None else False))
        use_aux = eagle.get("use_aux_hidden_state", d.get("use_aux_hidden_state", True))
        draft_vocab = d.get("draft_vocab_size")
        return _build(
            cls,
            fields,
            flags,
            use_aux=bool(use_aux),
            draft_vocab_size=draft_vocab,
            target_hidden_size=d.get("target_hidden_size"),
            capture=_capture_from(d, num_target_layers, bool(use_aux)),
        )

    def to_hf_dict(self, *, torch_dtype: str | None = None) -> dict[str, Any]:
        """The official EAGLE-3 ``config.json``; flags and capture indices are written explicitly."""
        d: dict[str, Any] = {"architectures": [OFFICIAL_ARCHITECTURE], "model_type": "llama"}
        d.update(self._llama_dict())
        d["draft_vocab_size"] = self.draft_vocab_size
        d["tie_word_embeddings"] = False
        if self.target_hidden_size != self.hidden_size:
            # Official EAGLE reads the presence of this key as "do not copy the target's embedding".
            d["target_hidden_size"] = self.target_hidden_size
        for name in FLAGS:
            d[name] = getattr(self, name)
        if self.capture_indices is not None:
            d[CONFIG_KEY] = list(self.capture_indices)
        if not self.use_aux_hidden_state:
            d["eagle_config"] = {"use_aux_hidden_state": False}
        if torch_dtype is not None:
            d["torch_dtype"] = torch_dtype
        return d

    # ----------------------------------------------------------------------------------------------
    @classmethod
    def from_speculators_dict(cls, d: Mapping[str, Any], num_target_layers: int | None = None) -> DraftConfig:
        """Read a speculators ``config.json`` (``speculators_model_type: "eagle3"``).

        ``norm_before_residual`` defaults to True when absent (vLLM's translation of speculators configs);
        the other flags default to False.
        """
        kind = d.get("speculators_model_type")
        if kind != "eagle3":
            raise CheckpointError(
                f"speculators_model_type is {kind!r}; only 'eagle3' speculators checkpoints are supported"
            )
        layer = d.get("transformer_layer_config") or d.get("transformer_config")
        if not isinstance(layer, Mapping):
            raise CheckpointError(
                "speculators config.json has no transformer_layer_config dict (the Llama decoder-layer "
                "config); it is required"
            )
        model_type = layer.get("model_type", "llama")
        if model_type != "llama":
            raise CheckpointError(
                f"transformer_layer_config.model_type is {model_type!r}; only 'llama' decoder layers are "
                "supported (qwen3 draft layers carry q_norm/k_norm weights this head does not have)"
            )
        if layer.get("mlp_bias"):
            raise CheckpointError("transformer_layer_config sets mlp_bias: true; not supported")
        fields = _llama_fields(layer, "transformer_layer_config")
        flags = {name: bool(d.get(name, False)) for name in FLAGS}
        flags["norm_before_residual"] = bool(d.get("norm_before_residual", True))
        return _build(
            cls,
            fields,
            flags,
            use_aux=True,
            draft_vocab_size=d.get("draft_vocab_size"),
            target_hidden_size=d.get("target_hidden_size"),
            capture=_capture_from(d, num_target_layers, True),
        )

    def to_speculators_dict(
        self,
        *,
        speculative_tokens: int = 3,
        verifier_name_or_path: str | None = None,
        verifier_architectures: Sequence[str] = (),
        torch_dtype: str | None = None,
    ) -> dict[str, Any]:
        """The speculators ``config.json`` (EAGLE31_SPEC §3.2); every flag written explicitly."""
        if not self.use_aux_hidden_state:
            raise ValueError(
                "the speculators eagle3 layout always has an fc fusion layer; a head with "
                "use_aux_hidden_state=false can only be saved in the official layout"
            )
        layer = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **self._llama_dict()}
        layer["tie_word_embeddings"] = False
        distinct_target = self.target_hidden_size != self.hidden_size
        d: dict[str, Any] = {
            "architectures": [SPECULATORS_ARCHITECTURE],
            "speculators_model_type": "eagle3",
            "draft_vocab_size": self.draft_vocab_size,
            **{name: getattr(self, name) for name in FLAGS},
            "target_hidden_size": self.target_hidden_size if distinct_target else None,
            CONFIG_KEY: list(self.capture_indices) if self.capture_indices is not None else None,
            "embed_requires_grad": False,
            "transformer_layer_config": layer,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": speculative_tokens,
                        "accept_tolerance": 0.0,
                        "verifier_accept_k": 1,
                    }
                ],
                "default_proposal_method": "greedy",
                "verifier": {
                    "name_or_path": verifier_name_or_path,
                    "architectures": list(verifier_architectures),
                },
            },
        }
        if torch_dtype is not None:
            d["torch_dtype"] = torch_dtype
        return d

    def _llama_dict(self) -> dict[str, Any]:
        return {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling is not None else None,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": False,
            "vocab_size": self.vocab_size,
        }


# --------------------------------------------------------------------------------------------------
def _require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _normalise_rope_scaling(scaling: Mapping[str, Any]) -> dict[str, Any] | None:
    """``rope_parameters``/``rope_scaling`` minus ``rope_theta``; legacy ``type`` becomes ``rope_type``."""
    out = {k: v for k, v in scaling.items() if k != "rope_theta"}
    if "type" in out:
        legacy = out.pop("type")
        out.setdefault("rope_type", legacy)
    out.setdefault("rope_type", "default")
    if out == {"rope_type": "default"}:
        return None
    return out


def _rope_from_dict(d: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) of a config dict of transformers 4 (legacy keys) or 5 (rope_parameters)."""
    params = d.get("rope_parameters")
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", d.get("rope_theta"))
        scaling: Mapping[str, Any] | None = params
    else:
        theta = d.get("rope_theta")
        scaling = d.get("rope_scaling")
    theta = 10000.0 if theta is None else float(theta)
    return theta, (_normalise_rope_scaling(scaling) if scaling else None)


def _llama_fields(d: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Llama fields of a config dict, absent ones filled with transformers' ``LlamaConfig`` defaults."""
    from transformers import LlamaConfig

    given = {k: d[k] for k in _LLAMA_KEYS if d.get(k) is not None}
    try:
        lc = LlamaConfig(**given)
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{where} is not a valid Llama config: {e}") from e
    theta, scaling = _rope_from_dict(lc.to_dict())
    return {
        "hidden_size": lc.hidden_size,
        "intermediate_size": lc.intermediate_size,
        "num_attention_heads": lc.num_attention_heads,
        "num_key_value_heads": lc.num_key_value_heads,
        "head_dim": getattr(lc, "head_dim", None),
        "vocab_size": lc.vocab_size,
        "num_hidden_layers": lc.num_hidden_layers,
        "hidden_act": lc.hidden_act,
        "rms_norm_eps": lc.rms_norm_eps,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": lc.max_position_embeddings,
        "attention_bias": bool(lc.attention_bias),
    }


def _official_layers(stated: Any) -> int:
    """The layer count of an official-layout head: one. SafeAILab EAGLE's EAGLE-3 draft (``eagle/model/cnets.py``,
    ``Model``) builds a single ``midlayer`` whatever ``num_hidden_layers`` says, so its configs may leave the key
    out; ``LlamaConfig``'s default (32) would describe layers the file does not have. A stated count other than
    1 is refused: this head has one layer and the official layout no key for more."""
    if stated is None or stated == 1:
        return 1
    raise CheckpointError(
        f"config.json states num_hidden_layers: {stated!r}, but an official-layout EAGLE-3 head has exactly one "
        "decoder layer (midlayer.*, with 2H-wide attention inputs); the official loader builds that one layer "
        "whatever the key says. If the weights hold midlayer.* (or layers.0.*) tensors only, set "
        "num_hidden_layers to 1 (or remove it); multi-layer drafts (layers.1.* and up) are not supported"
    )


def _capture_from(
    d: Mapping[str, Any], num_target_layers: int | None, use_aux: bool
) -> tuple[int, ...] | None:
    """Capture indices stated by a config (capture-index semantics), resolved if the layer count is known."""
    eagle = d.get("eagle_config") if isinstance(d.get("eagle_config"), Mapping) else {}
    stated = d.get(CONFIG_KEY)
    if stated is None:
        stated = eagle.get(CONFIG_KEY)
    try:
        if num_target_layers is None:
            return None if stated is None else tuple(int(i) for i in stated)
        if stated is None and not use_aux:
            return (num_target_layers,)
        return capture_indices_from_config(d, num_target_layers)
    except ValueError as e:
        raise CheckpointError(f"config.json {CONFIG_KEY}: {e}") from e


def _build(cls, fields, flags, *, use_aux, draft_vocab_size, target_hidden_size, capture) -> DraftConfig:
    try:
        return cls(
            **fields,
            **flags,
            use_aux_hidden_state=use_aux,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=target_hidden_size,
            capture_indices=capture,
        )
    except ValueError as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"config.json describes an unsupported draft head: {e}") from e
