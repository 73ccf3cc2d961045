"""A Tree of the file layer (gpuvfio.files) that only reads: what a dry run's Context holds."""

from __future__ import annotations

from gpuvfio.files import ReadOnly, Tree, split

__all__ = ["ReadOnlyTree"]


class ReadOnlyTree(Tree):
    """A Tree that refuses every write (no directory made, no file written, renamed, removed, no
    lock opened): a dry run's state dir, so "it changes nothing" holds by construction."""

    def _refuse(self, what: str):
        raise ReadOnly(f"{what} under {self.path()} refused: this context only reads (a dry run, a recording)")

    def sub(self, rel: str) -> "Tree":
        return ReadOnlyTree(self.top, "/".join(self.base + split(rel)))

    def open_dir(self, parts: list[str], *, create: bool = False, mode: int = 0o755) -> int | None:
        if create:  # every write makes or opens its parents this way first
            self._refuse("writing")
        return super().open_dir(parts, mode=mode)

    def replace_with(self, tmp_rel: str, rel: str) -> None:
        self._refuse("renaming")

    def remove(self, rel: str) -> bool:
        self._refuse("removing")

    def open_attribute(self, rel: str) -> int:
        self._refuse("writing")
