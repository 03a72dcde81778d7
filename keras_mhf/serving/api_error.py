"""The errors a client of `keras-mhf serve` gets, in the OpenAI API's shape."""


class ApiError(Exception):
    """A refused request: its HTTP status and the OpenAI error body
    `{"error": {"message", "type", "param", "code"}}`.

    Args:
        status: the HTTP status (400 bad value, 404 unknown model or route,
            413 body too large, 422 malformed field, 500 server error).
        message: one line: what was wrong and what to do.
        param: the request field at fault, or `None`.
        code: a short machine-readable code, or `None`.

    Example:

    ```python
    raise ApiError(400, "n must be 1; got 3.", param="n")
    ```
    """

    TYPES = {
        400: "invalid_request_error",
        404: "not_found_error",
        413: "invalid_request_error",
        422: "invalid_request_error",
        500: "server_error",
        503: "server_error",
    }

    def __init__(self, status, message, param=None, code=None):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.code = code

    def body(self):
        """The JSON body of the error response."""
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }
