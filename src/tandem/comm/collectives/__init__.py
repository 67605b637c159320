"""The collectives: the user-facing ones (`td.allreduce`, `td.broadcast`, ... in `user`), checked,
and the hot paths' unchecked twins (`direct`).

What is where:

- `direct`: Collectives of tandem's hot paths: straight to the engine, no check, nothing read on
  the host.
- `finite`: `td.all_finite(loss)`: skip a step on every rank together, or on none.
- `gather_scatter`: `td.gather` and `td.scatter`: the rooted pair of `allgather` and
  `broadcast`.
- `tensors`: Many tensors at once: each tensor once (shared weights), packed into a few flat
  messages.
- `user`: The user-facing collectives: one name each, with `inplace=` and `async_op=`.
"""
