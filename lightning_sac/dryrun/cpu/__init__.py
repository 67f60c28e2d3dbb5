"""The CPU target's kernels as the dry run counts them: oneDNN and RNN scratch measured per signature, promotion."""
