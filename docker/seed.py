"""Seeds a compose deployment with the embedded default: writes the tiny base model into the shared
model volume (unless a model is already there) and uploads the demo adapters to the S3 bucket.

Environment: LORASERVE_BASE_MODEL (model dir), LORASERVE_S3_ENDPOINT_URL, SEED_BUCKET,
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_DEFAULT_REGION (standard boto3 configuration).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import boto3
from botocore.exceptions import ClientError

from loraserve.adapter_store.demo import write_demo_adapters
from loraserve.inference_worker.model.tiny import write_tiny_llama


def main() -> int:
    model_dir = Path(os.environ.get("LORASERVE_BASE_MODEL", "/models/base"))
    if not (model_dir / "config.json").exists():
        write_tiny_llama(model_dir)
        print(f"wrote the tiny base model to {model_dir}")
    bucket = os.environ.get("SEED_BUCKET", "adapters")
    s3 = boto3.client("s3", endpoint_url=os.environ.get("LORASERVE_S3_ENDPOINT_URL"))
    try:
        s3.head_bucket(Bucket=bucket)
    except ClientError:
        s3.create_bucket(Bucket=bucket)
    with tempfile.TemporaryDirectory() as tmp:
        for name, directory in write_demo_adapters(tmp, model_dir).items():
            for f in ("adapter_config.json", "adapter_model.safetensors"):
                s3.upload_file(str(directory / f), bucket, f"{name}/{f}")
            print(f"uploaded s3://{bucket}/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
