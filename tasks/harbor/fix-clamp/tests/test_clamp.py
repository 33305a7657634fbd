"""Four checks of /app/clamp.py; the reward is the fraction that pass (standard library only)."""

import json
import sys

sys.path.insert(0, "/app")
CASES = [((5, 0, 10), 5), ((-3, 0, 10), 0), ((0, 0, 10), 0), ((12, 0, 10), 10)]
passed = 0
try:
    from clamp import clamp
except Exception as e:  # an unimportable module passes nothing
    print(f"import failed: {e}")
    clamp = None
for args, want in CASES:
    try:
        ok = clamp is not None and clamp(*args) == want
    except Exception:
        ok = False
    print(f"clamp{args} == {want}: {'ok' if ok else 'FAILED'}")
    passed += ok
with open("/logs/verifier/reward.json", "w") as f:
    json.dump({"reward": passed / len(CASES)}, f)
