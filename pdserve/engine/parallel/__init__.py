"""Tensor parallelism: which slice each rank holds (`plan`), how checkpoint tensors are
cut (`weights`), the group's collectives (`comm`), the step inputs rank 0 broadcasts
(`steps`), the follower ranks (`ranks`), the shared KV pool (`shared_pool`) and rank 0's
runner (`runner.make_runner`)."""
