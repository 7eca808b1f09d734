"""The floor of reference math that passes, runtime and kernel references share: slot masks, the draft tree's
data, verification (greedy and lossless sampling) and KV compaction. Imports only torch and `errors`, so
every higher floor (kernels, draft, passes, calibrate, runtime) can use it without a cycle."""
