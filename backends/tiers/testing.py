"""The tier conformance suite: what every :class:`~paramstore.backends.tiers.base.Tier` must do.

Shipped with the package so that a new tier is tested by it. Subclass :class:`TierTests` in a
pytest module and provide a ``tier`` fixture that yields a fresh, empty tier::

    import pytest
    from paramstore.backends.tiers.testing import TierTests

    class TestMyTier(TierTests):
        @pytest.fixture
        def tier(self, tmp_path):
            with MyTier(str(tmp_path)) as t:
                yield t

Every test below then runs against it (paramstore's own tests do this for the local tier, a
``file://`` remote and an S3 API). The tests write real files of a few KiB in pytest's
``tmp_path`` and need nothing else. Requires pytest (``paramstore[dev]``).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import blake3
import pytest

from paramstore.errors import InvalidArgumentError
from paramstore.validate import check_digest

from .base import Tier, object_key

__all__ = ["TierTests", "sample_object"]


def sample_object(tmp_path: Any, label: str, size: int = 4096) -> tuple[str, str, bytes]:
    """A file of ``size`` pseudo-random bytes under ``tmp_path`` and a digest named after ``label``.

    Returns ``(digest, path, data)``. (The tier contract does not check that bytes match their
    digest, so any 64-hex name works; this one is blake3 of the label.)
    """
    data = b"".join(blake3.blake3(f"{label}/{i}".encode()).digest() for i in range(-(-size // 32)))[:size]
    digest = blake3.blake3(label.encode()).hexdigest()
    path = os.path.join(str(tmp_path), f"src-{digest[:16]}")
    with open(path, "wb") as f:
        f.write(data)
    return digest, path, data


class TierTests:
    """Conformance tests for a tier; subclasses provide the ``tier`` fixture (a fresh, empty tier)."""

    @pytest.fixture
    def tier(self) -> Tier:  # pragma: no cover - overridden
        raise NotImplementedError("subclass TierTests and provide a `tier` fixture")

    # -- put / exists / size / get ------------------------------------------------------------
    def test_empty(self, tier: Tier) -> None:
        assert list(tier.list()) == []
        assert not tier.exists("0" * 64)
        with pytest.raises(FileNotFoundError):
            tier.size("0" * 64)
        with pytest.raises(FileNotFoundError):
            tier.get("0" * 64)

    def test_put_then_read_back(self, tier: Tier, tmp_path: Any) -> None:
        digest, path, data = sample_object(tmp_path, "a", 10_000)
        assert tier.put(digest, path) is True
        assert os.path.exists(path), "put without move must leave the source file"
        assert tier.exists(digest)
        assert tier.size(digest) == len(data)
        assert tier.get(digest) == data
        assert list(tier.list()) == [digest]
        assert tier.sizes([digest, "1" * 64]) == {digest: len(data)}

    def test_ranged_reads(self, tier: Tier, tmp_path: Any) -> None:
        digest, path, data = sample_object(tmp_path, "r", 9_000)
        tier.put(digest, path)
        for start, end in [(0, 1), (100, 4196), (8_999, 9_000), (5, None), (0, None), (4_000, 4_000)]:
            assert tier.get(digest, start, end) == data[start:end], (start, end)
        assert tier.get(digest, 8_000, 20_000) == data[8_000:], "a range past the end is clipped"
        with pytest.raises(InvalidArgumentError):
            tier.get(digest, -1, 5)
        with pytest.raises(InvalidArgumentError):
            tier.get(digest, 10, 5)

    def test_put_is_idempotent(self, tier: Tier, tmp_path: Any) -> None:
        digest, path, data = sample_object(tmp_path, "i")
        assert tier.put(digest, path) is True
        assert tier.put(digest, path) is False
        assert tier.get(digest) == data and list(tier.list()) == [digest]

    def test_put_move_takes_the_file(self, tier: Tier, tmp_path: Any) -> None:
        digest, path, data = sample_object(tmp_path, "m")
        staged = _stage(tier, path)
        assert tier.put(digest, staged, move=True) is True
        assert not os.path.exists(staged), "put(move=True) must consume the source file"
        assert tier.get(digest) == data
        again = _stage(tier, path)
        assert tier.put(digest, again, move=True) is False
        assert not os.path.exists(again), "an existing object: the moved source is removed"

    def test_put_move_from_anywhere(self, tier: Tier, tmp_path: Any) -> None:
        """``move=True`` works from any local directory (another filesystem too: copied, then removed)."""
        digest, path, data = sample_object(tmp_path, "anywhere")
        assert tier.put(digest, path, move=True) is True
        assert not os.path.exists(path)
        assert tier.get(digest) == data

    def test_put_of_a_missing_file(self, tier: Tier, tmp_path: Any) -> None:
        with pytest.raises(FileNotFoundError):
            tier.put("4" * 64, os.path.join(str(tmp_path), "no-such-file"))
        assert not tier.exists("4" * 64)

    def test_get_file(self, tier: Tier, tmp_path: Any) -> None:
        digest, path, data = sample_object(tmp_path, "f", 70_000)
        tier.put(digest, path)
        out = os.path.join(str(tmp_path), "copy")
        tier.get_file(digest, out)
        with open(out, "rb") as f:
            assert f.read() == data
        with pytest.raises(FileNotFoundError):
            tier.get_file("2" * 64, os.path.join(str(tmp_path), "nothing"))
        with pytest.raises(FileExistsError):
            tier.get_file(digest, out)  # never overwrites a file

    def test_delete(self, tier: Tier, tmp_path: Any) -> None:
        keep, p1, d1 = sample_object(tmp_path, "keep")
        gone, p2, _ = sample_object(tmp_path, "gone")
        tier.put(keep, p1)
        tier.put(gone, p2)
        assert sorted(tier.list()) == sorted([keep, gone])
        tier.delete(gone)
        tier.delete(gone)  # absent: no error
        assert not tier.exists(gone) and tier.exists(keep)
        assert list(tier.list()) == [keep] and tier.get(keep) == d1

    def test_many_objects_listed(self, tier: Tier, tmp_path: Any) -> None:
        digests = set()
        for i in range(20):
            d, p, _ = sample_object(tmp_path, f"many{i}", 100 + i)
            tier.put(d, p)
            digests.add(d)
        assert set(tier.list()) == digests
        assert tier.sizes(sorted(digests)) == {d: tier.size(d) for d in digests}

    # -- names from outside are validated -----------------------------------------------------
    @pytest.mark.parametrize("bad", ["", "../../etc/passwd", "AB" * 32, "a" * 63, "a" * 65, "g" * 64,
                                     "/" + "a" * 63, "a" * 62 + "/.", None, 7])
    def test_bad_digests_are_refused(self, tier: Tier, tmp_path: Any, bad: Any) -> None:
        _, path, _ = sample_object(tmp_path, "x")
        out = os.path.join(str(tmp_path), "out")
        for call in (lambda: tier.exists(bad), lambda: tier.size(bad), lambda: tier.get(bad),
                     lambda: tier.put(bad, path), lambda: tier.delete(bad), lambda: tier.get_file(bad, out),
                     lambda: tier.sizes([bad]), lambda: tier.map(bad) if tier.mappable else check_digest(bad)):
            with pytest.raises(InvalidArgumentError):
                call()
        assert os.path.exists(path) and not os.path.exists(out)

    # -- concurrency --------------------------------------------------------------------------
    def test_concurrent_puts_of_one_digest(self, tier: Tier, tmp_path: Any) -> None:
        digest, path, data = sample_object(tmp_path, "c", 200_000)
        results: list[bool] = []
        errors: list[BaseException] = []

        def put() -> None:
            try:
                results.append(tier.put(digest, path))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=put) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert tier.get(digest) == data
        assert results.count(True) >= 1
        assert list(tier.list()) == [digest]

    # -- capabilities -------------------------------------------------------------------------
    def test_capability_flags_are_bools(self, tier: Tier) -> None:
        for flag in ("mappable", "ranged_reads", "atomic_put"):
            assert isinstance(getattr(tier, flag), bool), flag

    def test_map_matches_capability(self, tier: Tier, tmp_path: Any) -> None:
        digest, path, data = sample_object(tmp_path, "map")
        tier.put(digest, path)
        if tier.mappable:
            m = tier.map(digest)
            try:
                assert bytes(m) == data
                with pytest.raises(TypeError):
                    m[0] = 0  # read-only
            finally:
                m.close()
            cow = tier.map(digest, private=True)
            try:
                cow[0:4] = b"\xff\xff\xff\xff"  # copy-on-write: this process only
                assert cow[0:4] == b"\xff\xff\xff\xff"
            finally:
                cow.close()
            assert tier.get(digest) == data, "a private map's writes reached the object"
            with pytest.raises(FileNotFoundError):
                tier.map("3" * 64)
        else:
            with pytest.raises(NotImplementedError):
                tier.map(digest)

    def test_close_is_idempotent(self, tier: Tier) -> None:
        tier.close()
        tier.close()

    def test_key_layout(self, tier: Tier) -> None:
        d = "ab" + "0" * 62
        assert object_key(d) == f"objects/ab/{d}.safetensors"


def _stage(tier: Tier, path: str) -> str:
    """A fresh copy of ``path`` where the tier can take it over (its tmp/ when it has one)."""
    tmp = getattr(tier, "tmp_dir", None) or os.path.dirname(path)
    os.makedirs(tmp, exist_ok=True)
    dst = os.path.join(tmp, f"staged-{os.urandom(6).hex()}")
    with open(path, "rb") as fin, open(dst, "wb") as fout:
        fout.write(fin.read())
    return dst
