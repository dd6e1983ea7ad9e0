{
  "format": "p2p_diloco.manifest-signature.v1",
  "run_id": "public-example",
  "manifest": "public.toml",
  "manifest_hash": "5151435fb4d8584d",
  "sha256": "19b4901d65b725be90797e14ba986db6e3a0b9094ee842d2356fc73f87c11b59",
  "files": [],
  "signer": "QmRb8xVU5LN2ZJYZXGko8vbvA5vysZx2aokgXBtP9Uufe5",
  "public_key": "CAASpgIwggEiMA0GCSqGSIb3DQEBAQUAA4IBDwAwggEKAoIBAQDJuiXHr97E0nBBI5SE+QwtvM1VIDUEe+8A0azwEiEWMO6Piis4UPqUDd2smCqdVN0wB0gwBmgnAbK1dxc4Ot+pA6NmP1xLocBTfVTQQL/h/zH8ZgHGO5dC8Ru2gMDtfcrVUddE/qw7fi2Y29QANceM0NudHzAx0g4jKHK/+c4I0IWX66y1GzMXKPdljmot+yQNcoliZstSNWFpkA9cvXSv/6a1556A/5TAVV6D7tC3SHCnB/G9Prt2uvjEnYash9DiLCUPx2wNrrZ5aflHxlsDfmFHHwk7Kx8o3tZOsbnJvpmoyK++DJjB/6z/NZm0BVA0x5MZOzA5WI9sN2dLJrHlAgMBAAE=",
  "signature": "kQaqcr6YGs1BkHewQv6BmzfTijkM7KOg1eXX0XHuwG49Wx4WlM3Gb5Fch44sy6YjhxuqlLwLQAOyzDx+2SB61WKK6BN/itbvn7ntzHPNvQZL5npgN1Hs7SA5awTQuYJAD9jebCIq5Kv3o8+0jDVvsmI78k7pX8C05363gGnx18DOdxbkgRU3frqg5IntqaoJd0YjedfxgXaLjPpz6GcjkhfSVWfXovEUuY+Fvad9EG1aHpoFpznvTRZyjzeC3uZYUr5odhUZS3EV+N8nqO7P/YNfb2ziFYhlgQ2PE+C0NF7lyF0qHHxYMCcppvU89g+Xfxni42kGM4cchtsYfVBtBg=="
}
