"""`trl.experimental`'s module paths, from rlft: `rlft.experimental.async_grpo`."""
