"""What autograd's engine does between backward nodes, as eager does it: its input buffers' gradient sums."""
