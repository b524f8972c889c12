"""The Force-3 loop and what it drives: levels, policy, lockstep, forwards, output."""
