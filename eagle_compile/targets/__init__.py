"""Target models that ship with eagle_compile: the embedded default, SmolLM2-135M-Instruct (DESIGN.md §6)."""

from eagle_compile.targets.default import DEFAULT_TARGET_NAME, default_target_folder, load_default_target, load_target

__all__ = ["DEFAULT_TARGET_NAME", "default_target_folder", "load_default_target", "load_target"]
