"""Bearer-token authentication: every data route needs `Authorization: Bearer <API_TOKEN>`.

The token is compared in constant time (`hmac.compare_digest`). Without API_TOKEN configured the API
fails closed: the server refuses to start (see `pipeline.api.app`), and should a request reach a route
anyway it is refused like a wrong token. `pipeline run` generates a development token and prints it.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from pipeline.config import get_settings

bearer = HTTPBearer(
    auto_error=False,
    scheme_name="token",
    description="The API_TOKEN of the deployment, sent as `Authorization: Bearer <token>`.",
)


def token_matches(presented: str) -> bool:
    expected = get_settings().api_token
    if expected is None:
        return False
    return hmac.compare_digest(presented.encode("utf-8"), expected.get_secret_value().encode("utf-8"))


def require_token(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
    """Dependency of every protected route: 401 unless the bearer token is the configured one."""
    if credentials is None or credentials.scheme.lower() != "bearer" or not token_matches(credentials.credentials):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            detail="missing or invalid bearer token",
            headers={"WWW-Authenticate": "Bearer"},
        )
