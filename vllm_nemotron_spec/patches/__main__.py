"""``python -m vllm_nemotron_spec.patches``: every patch target's fingerprint on the installed vLLM.

For reviewing a new vLLM release: a target marked ``CHANGED`` has code its patch was not checked
against (the patch will not install there). Read that symbol's new code against the patch; when
the patch still holds, add the printed fingerprint to the patch's ``TARGETS`` with the version.
Exit status 1 when any target changed or is missing.
"""

from __future__ import annotations

import importlib
import sys

from vllm_nemotron_spec import patches


def describe(patch: patches.Patch) -> list[str]:
    module = importlib.import_module(f"{patches.__name__}.{patch.name}")
    lines = []
    for target in getattr(module, "TARGETS", ()):
        try:
            obj = patches._lookup(importlib.import_module(target.module), target.qualname)
            found = patches.fingerprint(getattr(obj, "__wrapped__", obj))
        except (AttributeError, ModuleNotFoundError) as e:
            if target.absent_upstream:  # allowed: nothing needs the patch there
                lines.append(f"  absent   {target.where} (not needed: {target.absent_upstream})")
            else:
                lines.append(f"  MISSING  {target.where}: {e}")
            continue
        except Exception as e:  # missing module, no source
            lines.append(f"  MISSING  {target.where}: {type(e).__name__}: {e}")
            continue
        if found in target.checked:
            verdict = f"ok       {target.where} {found} (as on {target.checked[found]})"
        elif found in target.fixed_upstream:
            verdict = f"fixed    {target.where} {found} (upstream fix, as on {target.fixed_upstream[found]})"
        else:
            verdict = f"CHANGED  {target.where} {found}"
        lines.append("  " + verdict)
    return lines


def main() -> int:
    print(f"vLLM {patches.vllm_version()}")
    bad = False
    for patch in patches.PATCHES:
        lines = describe(patch)
        bad |= any(line.lstrip().startswith(("CHANGED", "MISSING")) for line in lines)
        print(f"{patch.name} ({'CPU only' if patch.cpu_only else 'all platforms'})")
        print("\n".join(lines) if lines else "  (no vLLM symbol)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
