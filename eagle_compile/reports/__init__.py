"""Reports over many generate calls: `drift` (tau and the drift monitors against context length and prompt format)."""
