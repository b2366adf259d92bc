"""What generate needs besides the method: its arguments checked, the sampler, torch.compile's
plumbing, memory (what fits, and compiled decoding's kept caches)."""
