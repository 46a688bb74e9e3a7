"""What the CLI refuses before it sends anything, against moto with the template's resources: an
upload under a partner that is not registered, an import from a bucket that does not exist."""

from __future__ import annotations

from pathlib import Path

import boto3
import pytest
from tests.functions.test_audit import register_outputs

from atelier import cli
from atelier.catalog import make_catalog, write_catalog
from atelier.local.provision import Provisioned


@pytest.fixture(scope="module")
def stack(module_stack: Provisioned) -> Provisioned:
    register_outputs(module_stack)  # the CLI finds the buckets and the table in the stack's outputs
    return module_stack


@pytest.fixture
def catalog(tmp_path: Path) -> Path:
    write_catalog(make_catalog(2), tmp_path / "catalog")
    return tmp_path / "catalog"


def uploaded(stack: Provisioned, partner: str) -> list[str]:
    listing = boto3.client("s3").list_objects_v2(Bucket=stack.outputs["UploadsBucketName"], Prefix=f"{partner}/")
    return sorted(o["Key"] for o in listing.get("Contents", []))


def test_an_upload_for_an_unregistered_partner_is_refused_before_any_byte(
        stack: Provisioned, catalog: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["-q", "upload", str(catalog), "--partner", "nobody"])

    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err == ("error: partner 'nobody' is not registered, so all 4 files would be quarantined as unlicensed: "
                   "register it with `atelier partner add nobody --license LICENSE`, or pass --force to upload anyway\n")
    assert uploaded(stack, "nobody") == []


def test_force_uploads_for_an_unregistered_partner_after_a_warning(
        stack: Provisioned, catalog: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["-q", "upload", str(catalog), "--partner", "stranger", "--force"])

    printed = capsys.readouterr()
    assert code == 0
    assert printed.err == ("warning: partner 'stranger' is not registered, so all 4 files would be quarantined as "
                           "unlicensed (uploading anyway: --force)\n")
    assert len(uploaded(stack, "stranger")) == 4 and "4 objects uploaded for partner stranger" in printed.out


def test_an_upload_for_a_registered_partner_warns_of_nothing(
        stack: Provisioned, catalog: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["partner", "add", "acme", "--license", "CC-BY-4.0"]) == 0
    capsys.readouterr()

    assert cli.main(["-q", "upload", str(catalog), "--partner", "acme"]) == 0

    assert capsys.readouterr().err == ""
    assert len(uploaded(stack, "acme")) == 4


def test_an_import_from_a_bucket_that_does_not_exist_is_one_sentence(
        stack: Provisioned, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["partner", "add", "laion", "--license", "CC-BY-4.0"]) == 0
    capsys.readouterr()

    code = cli.main(["-q", "import", "s3://no-such-bucket/shards/", "--partner", "laion", "--license", "CC-BY-4.0"])

    printed = capsys.readouterr()
    assert code == 2 and "Traceback" not in printed.err
    assert printed.err == ("error: there is no bucket 'no-such-bucket' (from s3://no-such-bucket/shards/): check the "
                           "URI; `aws s3 ls` lists the buckets you can read\n")
