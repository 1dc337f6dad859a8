"""The LM head and its loss as one op, without the logits: :func:`jaxact.linear_cross_entropy`."""
