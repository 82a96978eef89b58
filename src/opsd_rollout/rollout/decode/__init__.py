"""The static strategy's decode loop: ``loop`` (gpt-fast's shape: the two model calls, the per-slot state and the
order of things: admit, step, check), ``layouts`` (where keys/values live: copied or shared-prefix),
``lockstep`` (ranks under ZeRO-3) and ``stats``. ``docs/ARCHITECTURE.md`` walks through one token."""
