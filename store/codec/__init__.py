"""Encodings of hidden states other than the exact one: `int8_rotated` (8-bit codes of rotated, centred
states and a scale a token, with the error model that prices them in nats)."""
