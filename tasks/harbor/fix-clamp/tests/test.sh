#!/bin/bash
# Reward: the fraction of the checks in test_clamp.py that pass, as reward.json.
cd /app && python3 -I /tests/test_clamp.py
