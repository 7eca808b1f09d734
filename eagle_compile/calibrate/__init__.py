"""The EAGLE 3.1 calibration layer's decision math (DESIGN.md §4): the menu of programs, measured costs and
their on-disk cache, online acceptance estimates and the confidence map, the decision rule with fallback.
Pure host arithmetic over what the runtime measures and reads; `runtime/calibration.py` runs it."""
