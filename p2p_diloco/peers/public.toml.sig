{
  "format": "p2p_diloco.manifest-signature.v1",
  "run_id": "public-example",
  "manifest": "public.toml",
  "manifest_hash": "9cd6560f25021401",
  "sha256": "d0f75a545730d28849a9d322b5b0e715855bcf83498d496fdef1c6f6f6d3cb09",
  "files": [],
  "signer": "QmazHu7kAzHWydQr597Lq8rgfWeMP16Lx5QFFGyBybghp3",
  "public_key": "CAASpgIwggEiMA0GCSqGSIb3DQEBAQUAA4IBDwAwggEKAoIBAQC/L2lhciwAAZkwgHwdGDzONGUdWkYQBoVJ8qiWFcZtCEQOTZf7sWo1QvjAMOD+I/RQxZuQsLM2ul1vp9GAj2+IhIJW9WCUBHNkMByB7KoI29ZdKKl5dB9jCKKQnZ2PMm8yqH9kKgAL2IhNXmIPtw1JDNeUdoBa/Y4iJyCY7YBNWnAqH2inRcpMl11HtXE6IFNG9Qr1HH3KJQScYRFDq/583sR6MU3W/rq5KrTcv8+UJZMNN4RezoPwedy9qtYcNYnPaTvzmM7S0z7YfOO4pgKYCpWSba4YTFjjBfze75XD3p29tBvc0OHo299kggX7cBHmGqS1HjLieAuUihX7uYAvAgMBAAE=",
  "signature": "L7PcKoU9zn+VY9ZG9qPWCRKl6F7z+VyU7gcnam1F6l5roVWpKh0jD86CwDvUt8te83GA5fR6hwQsXyr26kru2GD0HCsgaNRkopFCDbZzDQVcZhpI31fK6LLgCERZhfZaVb0Yi5usLc68Xgm4sMb++OufsbF5T0K3gWx6BapwoaWoKOpLZh0cW2+lHSfVyHBbk6YEqqJl6O5M7e9+VV1yTXDDNXW5hsnUzzie8DBnpTXKKAeNUZ6yjbohGB2KFw1YlRGHqCHwWmZ4P7ZVP/x8V1I/nH0JE4hwjrt90RL83baxopZfWuOmN6LV+3AwIe9ObiJhH2P4u++jDAlxKar6/Q=="
}
