#!/bin/bash
# The reference fix: values above high become high.
sed -i '/x > high/{n;s/return low/return high/}' /app/clamp.py
