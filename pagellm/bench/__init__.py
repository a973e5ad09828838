"""Side-by-side benchmarks of PageLLM's prefix caching against the engines users would
pick instead (PageLLM without caching, Hugging Face transformers, vLLM's CPU build).

Every comparison runs its contenders one after another in one invocation, on the same
seeded prompts (token ids), and reports ratios, because absolute numbers on a shared
machine mean little while ratios taken minutes apart on the same load are comparable.
"""
