"""Private implementation of jaxact; import from `jaxact` instead."""
