#!/usr/bin/env python3
"""Writes an empty offers catalog for every offline provider of the installed gpuhunt, laid out
as gpuhunt downloads it (`<dir>/<provider>/version`, `<dir>/<provider>/<version>/catalog.zip`
holding `<provider>.csv`), so that a dstack server started with
`GPUHUNT_CATALOG_URL=file://<dir>` loads it instead of reaching the catalog bucket (which a
machine without internet access cannot; the server then logs an error for each provider).
An SSH fleet needs no offers: its instances come from the fleet.

Usage: offline_catalog.py DIR
"""

import io
import os
import sys
import zipfile

from gpuhunt._internal import catalog

VERSION = "offline"


def main(root: str) -> None:
    for provider in catalog.OFFLINE_PROVIDERS:
        directory = os.path.join(root, provider, VERSION)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(root, provider, "version"), "w") as f:
            f.write(VERSION + "\n")
        data = io.BytesIO()
        with zipfile.ZipFile(data, "w") as archive:
            archive.writestr(f"{provider}.csv", "")
        with open(os.path.join(directory, "catalog.zip"), "wb") as f:
            f.write(data.getvalue())


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
