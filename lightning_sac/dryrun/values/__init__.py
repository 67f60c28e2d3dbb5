"""The batch's real values in the dry run: what stays real, stand-ins for host reads, sizes from values."""
