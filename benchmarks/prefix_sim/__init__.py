"""Prefix-sharing cache simulators for DeepSeek-V4: our snapshot policy, upstream SGLang 0.5.23's
V4 policy (driven through its real classes) and no cache, replayed over token-level traces."""
