"""The machinery the object-store backends (S3, GCS) share; the storages themselves live in
:mod:`ckptio.backends` and keep only their request hooks.

- :mod:`.backend`: :class:`~.backend.ObjectStoreBackend`, the template (URIs, options, reads,
  ``stat``, paged ``list``, ``with_options``) a store fills in with request hooks;
- :mod:`.ranged`: parallel ranged reads into the caller's buffer, and running on the IO loop;
- :mod:`.multipart`: the bounded-memory streaming multipart writer;
- :mod:`.body`: request bodies over the caller's memory (no copies in botocore or aiohttp);
- :mod:`.direct`: GETs of presigned URLs whose bodies the kernel copies straight into the caller's memory;
- :mod:`.retry`: the retry policy, error classes and credential refresh every request runs under;
- :mod:`.s3_support`: S3-only machinery (error classification and translation, credentials files,
  the signer);
- :mod:`.s3_client`: the S3 client's configuration (endpoint, region, credentials, client hooks);
- :mod:`.s3_multipart`: the S3 multipart writer.
"""
