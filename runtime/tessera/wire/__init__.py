"""The types that cross a process boundary (frontend <-> engine core, leader <-> ranks) and their
msgpack codec: below every layer that sends or receives them."""
