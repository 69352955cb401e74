"""What runs when an optimized module is called: CUDA-graph runners, stream and event
callables, direct oneDNN and dispatcher calls, and the guards around rewritten graphs."""
