#!/bin/bash
# Reward 1 when /app/answer.txt holds the word count of /app/notes.txt, else 0.
expected=$(wc -w < /app/notes.txt)
answer=$(tr -d '[:space:]' < /app/answer.txt 2>/dev/null)
if [ "$answer" = "$expected" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
echo "expected $expected, answered '${answer}'"
