{
  "format": "p2p_diloco.manifest-signature.v1",
  "run_id": "public-example",
  "manifest": "public.toml",
  "manifest_hash": "6c616bd64c0d889a",
  "sha256": "e0d068046a23a03a4421c269ff6dcf6424295ea965cb92584ce75dc36e2e7927",
  "files": [],
  "signer": "QmZ9Btdsd5GGxuu6WPvnEZFjXGtQTJmJNmDdETPGJnC3aq",
  "public_key": "CAASpgIwggEiMA0GCSqGSIb3DQEBAQUAA4IBDwAwggEKAoIBAQDGdKglOKSMEea/1FOae7ihGvFrgSB7bx+z5ac+GB1qq+9Vsof6obTSdNjaNww5mOmbACjshHaRHpoKonuBc3ODjEvznxcutc0RkS+MsT3jVyLaHRH8oZpUY4woKrRwHgnunb+RN3UOJN4RzqvRBAGDDpeB+nHsZSy8D5nN48UkRdVt0sTYzXPRqiPpyLZKzTt4W8GZmlbTBsvoSknislF+SVEAS0Vby3lw1Oij/ln2FBptliecP1Doh7dZpIKOeYfEJxq7UZQc5lWZ9LV3f7o41E2lxfriizrAhKO5/eCE4TL1kEH4iZftQ6un3OKnaRZ00p7P3Z1rXaPBzDl6fwSvAgMBAAE=",
  "signature": "BFCfcu0a82P+1xit4vzWk+aBNqaCthmmrS/od4J2v0z8ey/eHt8rda+CZYBsJG2WZvj2JDWLCA2+BdbfwRAlJzH26CjhNqK1gAjL84WfYu/hhki9nxznfPfRe83z5em9tE791opRUaf3a2PS8B+eBeiKQMT6oGn5FwNWz+6Mmv0Fm92p7iAq0YSPZlRGZ4t3woQQSG5TqzRdLokEIUXOrNJvoAi4c0fTqHMw4732684cPy0FcSA128qsAm0xx9q6zxBmWTPmHXPPponry0rTlkPS46QnVHRALLh8dv1nd3C/pq+BeONKAdTpRUcLStVcs6gF0WiEQBQ8Zu/xl51C3A=="
}
