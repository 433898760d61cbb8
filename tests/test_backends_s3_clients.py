"""After a credential refresh the S3 backend closes the replaced client as soon as the requests
still using it end, instead of keeping one whole client per refresh until ``reset()``."""

from __future__ import annotations

import os

import ckptio
from faultproxy import Fault, MiB


class Provider:
    calls = 0

    def __call__(self):
        self.calls += 1
        return {"access_key_id": f"KEY{self.calls}", "secret_access_key": "secret", "session_token": "tok"}


def test_replaced_clients_are_closed_after_their_requests(s3_faults):
    provider = Provider()
    b, u = ckptio.resolve(s3_faults.uri + "/obj.bin", credential_provider=provider)
    data = os.urandom(16 * MiB)  # 4 parts of 5 MiB, 3 in flight
    for i in range(3):
        s3_faults.add(Fault("expired", method="PUT", path="partNumber=", nth=2))
        b.write(u + str(i), data)
        s3_faults.add(Fault("expired", method="GET", nth=1))
        assert b.read(u + str(i)) == data
        assert b._old_clients == [] and b._in_flight == {}
    assert provider.calls == 7
