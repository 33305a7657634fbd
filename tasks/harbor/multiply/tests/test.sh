#!/bin/bash
# Reward 1 for the right product in /app/answer.txt, else 0.
if [ "$(tr -d '[:space:]' < /app/answer.txt 2>/dev/null)" = "391" ]; then r=1; else r=0; fi
printf '{"reward": %s}\n' "$r" > /logs/verifier/reward.json
