"""Greedy token ids from the offline ``vllm.LLM`` API, in its own process (the Hub environment of
the caller applies): ``python llm_tokens.py '{"model": ..., "speculative_config": ...,
"prompts": [[ids]], "max_tokens": n}'`` prints one JSON line ``{"token_ids": [[...]]}``."""

import json
import sys

from vllm_nemotron_spec import runs

if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    runs.set_engine_defaults()
    llm = runs.make_llm(job["model"], job.get("speculative_config"), max_num_seqs=4)
    result = runs.generate(
        llm, [{"prompt_token_ids": p} for p in job["prompts"]], job["max_tokens"], "run"
    )
    print("TOKENS " + json.dumps({"token_ids": [list(t) for t in result.token_ids]}), flush=True)
    runs.release(llm)
