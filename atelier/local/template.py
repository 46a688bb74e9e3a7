"""Read template.yaml as CloudFormation would: SAM transform, parameters, intrinsic functions.

moto's CloudFormation neither expands SAM nor keeps bucket notifications, so the local stack
expands the template here (with AWS's own samtranslator) and creates each resource through the
service APIs (`provision.py`). Physical names are deterministic: `<stack>-<LogicalId>` where
the template names none.
"""

from __future__ import annotations

import copy
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

LOCAL_CODE_BUCKET = "atelier-local-code"
PSEUDO_PARAMETERS = ("AWS::StackName", "AWS::Region", "AWS::AccountId", "AWS::Partition", "AWS::URLSuffix")


NO_VALUE = object()  # what Ref AWS::NoValue resolves to: the property is left out


class TemplateError(ValueError):
    """The template uses something the local stack cannot read; the message says what."""


@dataclass
class Expanded:
    """A SAM template expanded to plain CloudFormation, with the values of its parameters."""

    resources: dict[str, dict[str, Any]]
    outputs: dict[str, dict[str, Any]]
    parameters: dict[str, str]
    conditions: dict[str, Any]
    code_dirs: dict[str, Path] = field(default_factory=dict)  # placeholder S3 key -> local folder
    list_parameters: set[str] = field(default_factory=set)  # CommaDelimitedList: Ref gives a list
    mappings: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)


class _NoManagedPolicies:
    """samtranslator asks IAM for managed policy names; the template uses ARNs and templates only."""

    def load(self) -> dict[str, str]:
        return {}


def load_overrides(samconfig: Path, environment: str) -> dict[str, str]:
    """`parameter_overrides` of one samconfig.toml environment, e.g. `[local.deploy.parameters]`."""
    if not samconfig.exists():
        return {}
    config = tomllib.loads(samconfig.read_text())
    raw = config.get(environment, {}).get("deploy", {}).get("parameters", {}).get("parameter_overrides", [])
    items = raw if isinstance(raw, list) else re.findall(r'(\w+)=("[^"]*"|\S+)', raw)
    pairs = [tuple(i.split("=", 1)) if isinstance(i, str) else i for i in items]
    return {k: v.strip('"') for k, v in pairs}


def load_tuning(root: Path, config_env: str) -> dict[str, str]:
    """tuning/<config env>.toml: the tuning knobs (variables) a local stack sets in every function's environment."""
    path = root / "tuning" / f"{config_env}.toml"
    return {k: str(v) for k, v in tomllib.loads(path.read_text()).items()} if path.exists() else {}


def set_environment(expanded: Expanded, variables: dict[str, str]) -> None:
    """Variables in every function's environment, over the template's: tuning knobs, set as `sam local invoke
    --env-vars` or a function configuration update would set them on AWS (their defaults are the settings')."""
    for resource in expanded.resources.values():
        if resource["Type"] == "AWS::Lambda::Function" and variables:
            properties = resource.setdefault("Properties", {})
            properties.setdefault("Environment", {}).setdefault("Variables", {}).update(variables)


def expand(path: Path, overrides: dict[str, str], stack: str, region: str, account: str) -> Expanded:
    # samtranslator takes 0.4 s to import: here, not at the top, so that every `atelier` command (which
    # imports this module for TemplateError) does not pay it
    from samtranslator.translator.transform import transform
    from samtranslator.yaml_helper import yaml_parse
    template = yaml_parse(path.read_text())
    code_dirs = _point_code_at_placeholders(template, path.parent)
    parameters = _parameter_values(template.get("Parameters", {}), overrides)
    list_parameters = {name for name, spec in template.get("Parameters", {}).items()
                       if str(spec.get("Type", "")).startswith(("CommaDelimitedList", "List<"))}
    parameters.update({"AWS::StackName": stack, "AWS::Region": region, "AWS::AccountId": account,
                       "AWS::Partition": "aws", "AWS::URLSuffix": "amazonaws.com"})
    cfn = transform(template, {k: v for k, v in parameters.items() if "::" not in k}, _NoManagedPolicies())
    return Expanded(cfn["Resources"], cfn.get("Outputs", {}), parameters, cfn.get("Conditions", {}), code_dirs,
                    list_parameters, cfn.get("Mappings", {}))


def _point_code_at_placeholders(template: dict[str, Any], root: Path) -> dict[str, Path]:
    """samtranslator only accepts S3 code locations, as `sam build` would upload them."""
    code_dirs: dict[str, Path] = {}

    def placeholder(uri: str) -> str:
        code_dirs[uri] = (root / uri).resolve()
        return f"s3://{LOCAL_CODE_BUCKET}/{uri}"

    function_globals = template.get("Globals", {}).get("Function", {})
    if isinstance(function_globals.get("CodeUri"), str):
        function_globals["CodeUri"] = placeholder(function_globals["CodeUri"])
    for resource in template.get("Resources", {}).values():
        props = resource.get("Properties", {})
        if resource.get("Type") == "AWS::Serverless::Function" and isinstance(props.get("CodeUri"), str):
            props["CodeUri"] = placeholder(props["CodeUri"])
        # a layer's packages come from the local environment (the venv has them); only its place is kept
        if resource.get("Type") == "AWS::Serverless::LayerVersion" and isinstance(props.get("ContentUri"), str):
            props["ContentUri"] = placeholder(props["ContentUri"])
    return code_dirs


def _parameter_values(declared: dict[str, Any], overrides: dict[str, str]) -> dict[str, str]:
    unknown = set(overrides) - set(declared)
    if unknown:
        raise TemplateError(f"parameter overrides name unknown parameters: {sorted(unknown)}")
    values: dict[str, str] = {}
    for name, spec in declared.items():
        if name in overrides:
            values[name] = overrides[name]
        elif "Default" in spec:
            values[name] = str(spec["Default"])
        else:  # CloudFormation: "Parameters: [X] must have values"
            raise TemplateError(f"parameter {name} has no default and no override: {spec.get('Description', '')}")
        check_parameter(name, spec, values[name])
    return values


def check_parameter(name: str, spec: dict[str, Any], value: str) -> None:
    """The constraints CloudFormation checks before it creates anything (AllowedPattern,
    AllowedValues, MinLength/MaxLength, MinValue/MaxValue), each item of a list type on its own."""
    why = spec.get("ConstraintDescription")
    kind = spec.get("Type", "String")
    listed = kind.startswith("List<") or kind == "CommaDelimitedList"
    for item in (value.split(",") if value else []) if listed else [value]:
        pattern = spec.get("AllowedPattern")
        if pattern is not None and not re.fullmatch(pattern, item):
            raise TemplateError(f"parameter {name}={item!r} {why or f'must match pattern {pattern}'}")
        if "AllowedValues" in spec and item not in [str(v) for v in spec["AllowedValues"]]:
            raise TemplateError(f"parameter {name}={item!r} must be one of {spec['AllowedValues']}")
        if "MinLength" in spec and len(item) < int(spec["MinLength"]) or "MaxLength" in spec and len(item) > int(spec["MaxLength"]):
            raise TemplateError(f"parameter {name}={item!r} must be {spec.get('MinLength', 0)}..{spec.get('MaxLength')} characters")
        if kind == "Number":
            try:
                number = float(item)
            except ValueError:
                raise TemplateError(f"parameter {name}={item!r} must be a number") from None
            if "MinValue" in spec and number < float(spec["MinValue"]) or "MaxValue" in spec and number > float(spec["MaxValue"]):
                raise TemplateError(f"parameter {name}={item} must be within {spec.get('MinValue')}..{spec.get('MaxValue')}")


class Resolver:
    """Resolves intrinsic functions against parameters and already-created resources."""

    def __init__(self, parameters: dict[str, str], conditions: dict[str, Any],
                 ref: Callable[[str], str], get_att: Callable[[str, str], Any],
                 list_parameters: set[str] | frozenset[str] = frozenset(),
                 mappings: dict[str, dict[str, dict[str, Any]]] | None = None) -> None:
        self.parameters = parameters
        self.list_parameters = list_parameters
        self.mappings = mappings or {}
        self.conditions = conditions
        self._ref = ref
        self._get_att = get_att

    def resolve(self, value: Any) -> Any:
        if isinstance(value, list):
            return [r for r in (self.resolve(v) for v in value) if r is not NO_VALUE]
        if not isinstance(value, dict):
            return value
        if len(value) == 1:
            (key, arg), = value.items()
            handler = self._intrinsics().get(key)
            if handler is not None:
                return handler(arg)
        return {k: r for k, r in ((k, self.resolve(v)) for k, v in value.items()) if r is not NO_VALUE}

    def _intrinsics(self) -> dict[str, Callable[[Any], Any]]:
        return {
            "Ref": self.ref, "Fn::GetAtt": self._fn_get_att, "Fn::Sub": self._fn_sub,
            "Fn::Join": lambda a: str(self.resolve(a[0])).join(str(v) for v in self.resolve(a[1])),
            "Fn::Select": lambda a: self.resolve(a[1])[int(self.resolve(a[0]))],
            "Fn::Split": lambda a: str(self.resolve(a[1])).split(self.resolve(a[0])),
            "Fn::If": lambda a: self.resolve(a[1] if self.condition(a[0]) else a[2]),
            "Fn::FindInMap": self._fn_find_in_map,
            "Fn::Equals": lambda a: str(self.resolve(a[0])) == str(self.resolve(a[1])),
            "Fn::Not": lambda a: not self.resolve(a[0]),
            "Fn::And": lambda a: all(self.resolve(v) for v in a),
            "Fn::Or": lambda a: any(self.resolve(v) for v in a),
            "Condition": self.condition,
        }

    def condition(self, name: str) -> bool:
        if name not in self.conditions:
            raise TemplateError(f"unknown condition {name}")
        return bool(self.resolve(self.conditions[name]))

    def ref(self, name: str) -> Any:
        if name == "AWS::NoValue":
            return NO_VALUE
        if name in self.list_parameters:
            return [item for item in self.parameters[name].split(",") if item] if self.parameters[name] else []
        if name in self.parameters:
            return self.parameters[name]
        return self._ref(name)

    def _fn_find_in_map(self, arg: Any) -> Any:
        name, top, second = (str(self.resolve(a)) for a in arg[:3])
        try:
            return self.mappings[name][top][second]
        except KeyError:  # CloudFormation fails the stack the same way
            raise TemplateError(f"Fn::FindInMap: {name} has no {top}.{second}") from None

    def _fn_get_att(self, arg: Any) -> Any:
        logical, attribute = arg.split(".", 1) if isinstance(arg, str) else arg
        return self._get_att(logical, self.resolve(attribute))

    def _fn_sub(self, arg: Any) -> str:
        text, variables = (arg, {}) if isinstance(arg, str) else (arg[0], self.resolve(arg[1]))

        def substitute(match: re.Match[str]) -> str:
            name = match.group(1)
            if name.startswith("!"):
                return "${" + name[1:] + "}"
            if name in variables:
                return str(variables[name])
            if "." in name and name not in self.parameters:
                logical, attribute = name.split(".", 1)
                return str(self._get_att(logical, attribute))
            return str(self.ref(name))

        return re.sub(r"\$\{([^}]+)\}", substitute, text)


def dependencies(resource: dict[str, Any]) -> set[str]:
    """Logical ids a resource refers to (Ref, GetAtt, Sub, DependsOn)."""
    found: set[str] = set()
    depends = resource.get("DependsOn", [])
    found.update([depends] if isinstance(depends, str) else depends)

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for key, arg in value.items():
                if key == "Ref" and isinstance(arg, str):
                    found.add(arg)
                elif key == "Fn::GetAtt":
                    found.add(arg.split(".", 1)[0] if isinstance(arg, str) else arg[0])
                elif key == "Fn::Sub":
                    text = arg if isinstance(arg, str) else arg[0]
                    found.update(m.split(".", 1)[0] for m in re.findall(r"\$\{([^}!]+)\}", text))
                walk(arg)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(copy.deepcopy(resource.get("Properties", {})))
    return found


def creation_order(resources: dict[str, dict[str, Any]]) -> list[str]:
    """Resources in an order where each comes after everything it refers to."""
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(name: str, path: tuple[str, ...]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise TemplateError(f"circular dependency: {' -> '.join(path + (name,))}")
        state[name] = "visiting"
        for dep in sorted(dependencies(resources[name]) & resources.keys()):
            visit(dep, path + (name,))
        state[name] = "done"
        order.append(name)

    for name in sorted(resources):
        visit(name, ())
    return order
