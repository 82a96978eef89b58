"""The static strategy's decode loop in small pieces (gpt-fast's shape): ``steps`` (the two model calls),
``state`` (per-slot tensors), ``layouts`` (where keys/values live: copied or shared-prefix), ``lockstep``
(ranks under ZeRO-3) and ``loop`` (the order of things: admit, step, check). ``docs/ARCHITECTURE.md`` walks
through one token."""
