"""`baton bench`: a serving benchmark in the shape of `vllm bench serve`, plus a concurrency sweep.

It drives any server speaking the OpenAI completions API (Baton, vLLM, llama.cpp's server) over
HTTP with streaming, and reports vLLM's metrics (TTFT, TPOT, ITL, E2EL, throughput, goodput) so
numbers can be compared across servers with the same tool.

    baton bench serve --num-prompts 100 --random-input-len 256 --random-output-len 64
    baton bench sweep --concurrency 1,4,16,64 --result-dir results/
"""
